"""Placements, tilings and local shapes.

A tensor's *tiling* on an N-D mesh is one placement per mesh axis:

* ``Shard(d)`` (``S(d)``): dimension ``d`` is cut into ``p`` chunks along that axis;
* ``Replicate()`` (``R``): every device of the axis holds the same values;
* ``Partial()`` (``P``): every device holds a summand; the tensor is their sum.

Chunks follow DTensor's rule: chunk size ``c = ceil(n / p)``, device ``k`` holds
``[k c, min((k+1) c, n))`` (possibly empty). Axes apply in mesh order: axis 0
cuts the full tensor, axis 1 cuts axis 0's chunk, and so on.  The helpers
``shard`` / ``assemble`` simulate every device's tile in one process; rules and
plans are validated with them against the serial op.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache

import torch

from .mesh import Mesh, all_coords


class Shard:
    """``S(dim)``: split along ``dim``.  Interned, one object per dim, so placements compare and hash
    by identity (in C): the planner compares and hashes tilings millions of times."""

    __slots__ = ("dim",)
    dim: int
    _interned: dict[int, Shard] = {}

    def __new__(cls, dim: int) -> Shard:
        dim = int(dim)
        it = cls._interned.get(dim)
        if it is None:
            fresh = super().__new__(cls)
            object.__setattr__(fresh, "dim", dim)
            # setdefault is atomic: ranks running as threads that intern the same dim at once agree
            it = cls._interned.setdefault(dim, fresh)
        return it

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("placements are immutable")

    def __reduce__(self) -> tuple:
        return (Shard, (self.dim,))

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


class _Singleton:
    """A placement with no parameters: one object, compared and hashed by identity."""

    __slots__ = ()
    _it: dict[type, _Singleton] = {}

    def __new__(cls) -> _Singleton:
        it = _Singleton._it.get(cls)
        if it is None:
            it = _Singleton._it.setdefault(cls, super().__new__(cls))  # atomic, as in Shard
        return it

    def __reduce__(self) -> tuple:
        return (type(self), ())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Replicate(_Singleton):
    """``R``: every device holds the whole tensor."""

    __slots__ = ()

    def __str__(self) -> str:
        return "R"


class Partial(_Singleton):
    """``P``: every device holds a summand of the tensor (a pending sum)."""

    __slots__ = ()

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial
Tiling = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


_PLACEMENT_RE = re.compile(r"^\s*(?:S\((\d+)\)|(R)|(P))\s*$")


def parse_placement(text: str) -> Placement:
    """Inverse of ``str``: ``"S(1)"``, ``"R"``, ``"P"``."""
    m = _PLACEMENT_RE.match(text)
    if not m:
        raise ValueError(f"bad placement {text!r}: expected S(<dim>), R or P")
    if m.group(1) is not None:
        return Shard(int(m.group(1)))
    return R if m.group(2) else P


def fmt(tiling: Sequence[Placement]) -> str:
    return ",".join(str(p) for p in tiling)


def to_torch(p: Placement):
    """The equivalent public ``torch.distributed.tensor`` placement."""
    from torch.distributed.tensor import Partial as TP, Replicate as TR, Shard as TS

    if isinstance(p, Shard):
        return TS(p.dim)
    return TR() if isinstance(p, Replicate) else TP()


def chunk_range(n: int, p: int, k: int) -> tuple[int, int]:
    """[start, stop) of chunk ``k`` of ``p`` of a length-``n`` dimension."""
    c = -(-n // p) if n else 0
    start = min(k * c, n)
    return start, min(start + c, n)


def intersect(x: tuple[int, int], y: tuple[int, int]) -> tuple[int, int]:
    """``[max start, min stop)`` of two ``[start, stop)`` ranges: empty (stop <= start) when they do not meet."""
    return max(x[0], y[0]), min(x[1], y[1])


def nested_range(n: int, members: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """[start, stop) of a length-``n`` dimension split on several mesh axes: ``members`` is each splitting axis'
    ``(size, my index)`` in mesh order, and each axis cuts the chunk the axes before it left (``chunk_range``)."""
    lo, hi = 0, n
    for p, k in members:
        s, e = chunk_range(hi - lo, p, k)
        lo, hi = lo + s, lo + e
    return lo, hi


def chunk_lengths(n: int, p: int) -> set[int]:
    """The lengths of the ``p`` chunks of a length-``n`` dimension (``chunk_range``), without walking them: the
    first ``n // c`` are ``c = ceil(n / p)`` long, the next holds the rest, and any after it are empty."""
    if n == 0:
        return {0}
    c = -(-n // p)
    full, rest = divmod(n, c)
    out = {c}
    if rest:
        out.add(rest)
    if full + (1 if rest else 0) < p:
        out.add(0)
    return out


def local_shape(shape: Sequence[int], tiling: Sequence[Placement], mesh: Mesh,
                coords: Sequence[int]) -> tuple[int, ...]:
    """Shape of the tile held by the device at ``coords``."""
    out = list(shape)
    for axis, pl in enumerate(tiling):
        if isinstance(pl, Shard):
            a, b = chunk_range(out[pl.dim], mesh.shape[axis], coords[axis])
            out[pl.dim] = b - a
    return tuple(out)


def max_local_numel(shape: Sequence[int], tiling: Sequence[Placement], mesh: Mesh) -> int:
    """Largest tile's element count (the device-0 tile: chunks shrink towards the end)."""
    return _max_local_numel(tuple(shape), tuple(tiling), mesh)


@lru_cache(maxsize=200_000)
def _max_local_numel(shape: tuple, tiling: tuple, mesh: Mesh) -> int:
    return math.prod(local_shape(shape, tiling, mesh, (0,) * mesh.ndim))


def split_factor(tiling: Sequence[Placement], mesh: Mesh, dim: int) -> int:
    """How many ways ``dim`` is cut in total."""
    f = 1
    for axis, pl in enumerate(tiling):
        if pl == Shard(dim):
            f *= mesh.shape[axis]
    return f


def is_valid(tiling: Sequence[Placement], shape: Sequence[int], mesh: Mesh) -> bool:
    """Shards name existing dims, and no device gets an empty tile of a non-empty dim."""
    return _is_valid(tuple(tiling), tuple(shape), mesh)


@lru_cache(maxsize=200_000)
def _is_valid(tiling: tuple, shape: tuple, mesh: Mesh) -> bool:
    if len(tiling) != mesh.ndim:
        return False
    for pl in tiling:
        if isinstance(pl, Shard) and not 0 <= pl.dim < len(shape):
            return False
    for d, n in enumerate(shape):
        f = split_factor(tiling, mesh, d)
        if f > 1 and n < f:
            return False
    return True


# ---- one-process simulation of all devices' tiles ---------------------------------


def shard(full: torch.Tensor, tiling: Sequence[Placement], mesh: Mesh,
          generator: torch.Generator | None = None) -> dict[tuple[int, ...], torch.Tensor]:
    """Every device's tile of ``full``; ``Partial`` summands are random but sum to ``full``."""
    tiles: dict[tuple[int, ...], torch.Tensor] = {}
    for coords in all_coords(mesh):
        t = full
        for axis, pl in enumerate(tiling):
            if isinstance(pl, Shard):
                a, b = chunk_range(t.shape[pl.dim], mesh.shape[axis], coords[axis])
                t = t.narrow(pl.dim, a, b - a)
        tiles[coords] = t.clone()
    # Partial: split each value into p random summands along every partial axis.  Replicas (devices
    # that differ only on R axes) must hold the same summand, so noise is keyed by the coordinates
    # of the Shard axes and of the partial axes already split.
    keyed: list[int] = [a for a, pl in enumerate(tiling) if isinstance(pl, Shard)]
    for axis, pl in enumerate(tiling):
        if not isinstance(pl, Partial):
            continue
        p = mesh.shape[axis]
        noise: dict[tuple, list[torch.Tensor]] = {}
        new: dict[tuple[int, ...], torch.Tensor] = {}
        for coords, t in tiles.items():
            key = tuple(coords[a] for a in keyed)
            if key not in noise:
                noise[key] = [torch.randn(t.shape, generator=generator, dtype=t.dtype) if t.is_floating_point()
                              else torch.zeros_like(t) for _ in range(p - 1)]
            ns = noise[key]
            new[coords] = t - sum(ns, torch.zeros_like(t)) if coords[axis] == 0 else ns[coords[axis] - 1]
        tiles = new
        keyed.append(axis)
    return tiles


def assemble(tiles: dict[tuple[int, ...], torch.Tensor], tiling: Sequence[Placement], mesh: Mesh,
             check_replicas: float | None = None) -> torch.Tensor:
    """Inverse of ``shard``: sum partials, concatenate shards (last axis first).

    With ``check_replicas`` set, replicas must agree to that absolute tolerance
    (a rule that leaves replicas different is wrong, not approximately right).
    """
    cur = dict(tiles)
    for axis in reversed(range(mesh.ndim)):
        pl = tiling[axis]
        groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for coords in cur:
            groups.setdefault(coords[:axis] + coords[axis + 1:], []).append(coords)
        nxt: dict[tuple[int, ...], torch.Tensor] = {}
        for key, members in groups.items():
            members.sort(key=lambda c: c[axis])
            ts = [cur[c] for c in members]
            if isinstance(pl, Shard):
                v = torch.cat(ts, dim=pl.dim)
            elif isinstance(pl, Partial):
                v = sum(ts[1:], ts[0])
            else:
                v = ts[0]
                if check_replicas is not None:
                    for o in ts[1:]:
                        if o.shape != v.shape or not torch.allclose(o, v, atol=check_replicas, rtol=0, equal_nan=True):
                            raise AssertionError(f"replicas differ on mesh axis {axis}")
            nxt[key] = v
        # re-key: drop this axis
        cur = {k: v for k, v in nxt.items()}
        cur = {tuple(k): v for k, v in cur.items()}
    return next(iter(cur.values()))


def local_tile(full: torch.Tensor, tiling: Sequence, mesh: Mesh, coords: Sequence[int],
               copy: bool = True) -> torch.Tensor:
    """This device's tile of a full tensor (``Partial`` never occurs for stored tensors); ``copy=False``: a view
    of ``full``."""
    t = full
    for axis, pl in enumerate(tiling):
        if isinstance(pl, Shard):
            a, b = chunk_range(t.shape[pl.dim], mesh.shape[axis], coords[axis])
            t = t.narrow(pl.dim, a, b - a)
    return t.clone() if copy else t
