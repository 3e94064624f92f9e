"""Spatial tiling: the output-to-input index map of a windowed op along one dim (registers no rule).

A convolution, pool, pad or upsample computes output row ``o`` of a spatial dim from a window of
input rows.  When that dim is split (``S(d)`` on input and output along one mesh axis), member
``k`` owns output rows ``[a, b) = chunk_range(n_out, p, k)`` and reads input rows ``[s, e)``,
which may reach past its own input chunk into its neighbours' (the *halo*, fetched by the
``halo`` kind of ``ir.kinds``; rows outside ``[0, n_in)`` hold the op's padding value
``fill``).  Running the op on those rows with its padding along ``d`` set to 0 yields global
output rows ``c, c + 1, ...``; the member keeps ``[a, b)`` (a crop when ``c != a``).  Per kind,
with stride ``t``, padding before ``q`` and extent ``x = dilation (kernel - 1) + 1``:

* ``conv``: ``[s, e) = [a t - q, (b - 1) t - q + x)``, ``c = a``;
* ``transposed``: every row ``i`` that reaches ``[a, b)`` (row ``i`` reaches ``i t - q + [0, x)``),
  widened until the local output covers ``[a, b)`` (a kernel shorter than the stride);
  ``c = s t - q``;
* ``nearest`` (integer scale ``r``): ``[s, e) = [floor(a / r), floor((b - 1) / r) + 1)``, ``c = r s``.

``conv`` also covers pooling (``fill = -inf`` for max) and padding ops (stride 1, extent 1,
``q`` the pad before; a negative pad crops).  The windows are exact for uneven tiles and for
tiles thinner than the halo (the rows then come from several members).  A dim may be split by
one mesh axis only: the tile along it is then one chunk.  A dim split on two axes, or a window
the op's semantics make position-dependent (``count_include_pad=False`` with padding, reflect
padding, a non-integer upsampling scale), is not offered by the rules.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..ir.kinds import Step
from ..mesh import Mesh
from ..tiling import Shard, chunk_range
from . import base
from .base import OpSpec, Strategy, lookup


@dataclass(frozen=True)
class Window:
    """How output rows along ``dim`` read input ``slot``'s rows (``dim`` is the same in both)."""

    slot: int          # index into ``op.inputs``
    dim: int
    n_in: int
    n_out: int
    kind: str = "conv"  # conv | transposed | nearest
    stride: int = 1     # nearest: the integer scale
    before: int = 0     # padding before (conv, transposed)
    extent: int = 1     # dilation * (kernel - 1) + 1
    fill: float = 0.0   # the value of rows outside [0, n_in)

    def need(self, a: int, b: int) -> tuple[int, int, int]:
        """``(s, e, c)``: output rows ``[a, b)`` read input rows ``[s, e)``; the op run on them (padding 0
        along ``dim``) yields global output rows from ``c`` on."""
        st, q, x = self.stride, self.before, self.extent
        if self.kind == "conv":
            return a * st - q, (b - 1) * st - q + x, a
        if self.kind == "nearest":
            s = a // st
            return s, (b - 1) // st + 1, s * st
        # transposed: input row i reaches output rows i*st - q + [0, x); keep every row that reaches
        # [a, b), and enough rows that the local output covers [a, b) (kernel shorter than stride).
        s = min(-((x - 1 - a - q) // st), (a + q) // st)
        e = max((b - 1 + q) // st, -((x - b - q) // st)) + 1
        return s, e, s * st - q

    def local_out(self, s: int, e: int) -> int:
        """Rows of the local output when the op runs on input rows ``[s, e)`` (padding 0)."""
        n = e - s
        if self.kind == "conv":
            return (n - self.extent) // self.stride + 1
        if self.kind == "nearest":
            return n * self.stride
        return (n - 1) * self.stride + self.extent

    # members and _owners are read for every strategy and by cost, lowering and the oracle alike; _owners is
    # O(p^2): computed once per (window, group size).
    @functools.lru_cache(maxsize=65536)  # noqa: B019 - windows are small frozen values, shared across builds
    def members(self, p: int) -> tuple[tuple[int, int], ...]:
        """Every member's input window ``(s, e)`` on a group of ``p`` (empty for an empty output tile)."""
        out = []
        for k in range(p):
            a, b = chunk_range(self.n_out, p, k)
            out.append(self.need(a, b)[:2] if b > a else (0, 0))
        return tuple(out)

    def crop(self, p: int, k: int) -> tuple[int, int, int]:
        """``(start, length, local rows)``: member ``k`` keeps ``length`` rows of its local output from
        ``start``; the op yields ``local rows`` rows."""
        a, b = chunk_range(self.n_out, p, k)
        s, e, c = self.need(a, b)
        return a - c, b - a, self.local_out(s, e)

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def _owners(self, p: int) -> list[list[int]]:
        """``rows[k][j]``: rows of member ``j``'s chunk in member ``k``'s window (``j != k``; 0 on the diagonal)."""
        wins, chunks = self.members(p), [chunk_range(self.n_in, p, j) for j in range(p)]
        return [[0 if j == k else max(0, min(e, hi) - max(s, lo)) for j, (lo, hi) in enumerate(chunks)]
                for k, (s, e) in enumerate(wins)]

    def halo_rows(self, p: int, backward: bool = False) -> int:
        """The most rows any member receives: its window's rows that others own (forward), or the gradient
        rows of its own rows that others' windows read (backward, the adjoint's traffic)."""
        rows = self._owners(p)
        if backward:
            return max(sum(rows[j][k] for j in range(p)) for k in range(p))
        return max(sum(r) for r in rows)

    def sources(self, p: int, backward: bool = False) -> int:
        """The most members any member receives rows from (its messages per exchange; ``backward`` as above)."""
        rows = self._owners(p)
        if backward:
            return max(sum(1 for j in range(p) if rows[j][k]) for k in range(p))
        return max(sum(1 for x in r if x) for r in rows)


def windows_of(op: OpSpec) -> list[Window]:
    """The op's windows (``[]`` for an op that is not windowed)."""
    entry = lookup(op.target)
    return entry.windows(op) if entry is not None and entry.windows is not None else []


def halos(windows: Sequence[Window], strategy: Strategy) -> list[tuple[int, Window]]:
    """``(mesh axis, window)`` of every windowed dim that ``strategy`` splits (its input is ``S(dim)``)."""
    return [(axis, w) for w in windows for axis, pl in enumerate(strategy.inputs[w.slot]) if pl == Shard(w.dim)]


def halo_step(w: Window, axis: int, mesh: Mesh) -> Step:
    """The ``halo`` step that reads ``w``'s rows along mesh ``axis``."""
    return Step("halo", axis, w.dim, full=w.n_in, windows=w.members(mesh.shape[axis]), fill=w.fill)


def local_rows(split: Sequence[tuple[int, Window]], mesh: Mesh, coords: Sequence[int]) -> list[tuple[Window, int]]:
    """``(window, input rows it reads)`` on the device at ``coords``: the op's ``window_args`` input."""
    out = []
    for axis, w in split:
        s, e = w.members(mesh.shape[axis])[coords[axis]]
        out.append((w, e - s))
    return out


def crops(split: Sequence[tuple[int, Window]], mesh: Mesh, coords: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(dim, start, length)`` of every crop the device at ``coords`` makes of the op's local output."""
    out = []
    for axis, w in split:
        start, length, rows = w.crop(mesh.shape[axis], coords[axis])
        if start or length != rows:
            out.append((w.dim, start, length))
    return out


@contextmanager
def spatial_splits(enabled: bool) -> Iterator[None]:
    """Plan with (``True``, the default) or without domain parallelism: inside ``with spatial_splits(False)``
    no strategy splits a windowed dim (the channel- and batch-split plans benchmarks compare against)."""
    token = base.SPATIAL_SPLITS.set(enabled)
    try:
        yield
    finally:
        base.SPATIAL_SPLITS.reset(token)


def spatial_list(v: int | Sequence[int], k: int) -> list[int]:
    """An int-or-list size argument (kernel, stride, padding, dilation) as ``k`` ints."""
    if isinstance(v, int):
        return [v] * k
    vals = [int(x) for x in v]
    return vals * k if len(vals) == 1 else vals


__all__ = ["Window", "crops", "halo_step", "halos", "local_rows", "spatial_list", "spatial_splits",
           "windows_of"]
