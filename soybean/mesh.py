"""An N-D device mesh as pure data.

A mesh of shape ``(p_0, ..., p_{n-1})`` numbers its ``P = prod p_i`` ranks in
row-major order: rank ``r`` has coordinates ``c`` with
``r = sum_i c_i * prod_{j>i} p_j``.  The process group of mesh axis ``i`` seen
from rank ``r`` is the set of ranks that agree with ``r`` on every coordinate
except ``c_i``.  Planning only needs this arithmetic, never a process group.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Mesh:
    """Mesh shape and axis names; ``Mesh((2, 4))`` is 2 x 4 = 8 devices."""

    shape: tuple[int, ...]
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(int(p) for p in self.shape)
        if not shape or any(p < 1 for p in shape):
            raise ValueError(f"mesh shape must be a non-empty tuple of positive ints, got {self.shape}")
        object.__setattr__(self, "shape", shape)
        names = tuple(self.names) or tuple(f"d{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(f"mesh has {len(shape)} axes but {len(names)} names")
        object.__setattr__(self, "names", names)

    @cached_property
    def _hash(self) -> int:
        return hash((self.shape, self.names))

    def __hash__(self) -> int:  # the pricing caches hash the mesh on every lookup: compute it once
        return self._hash

    def __getstate__(self) -> dict:
        # The cached hash is this process's (string hashing is salted per process): never pickle it.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinates of ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside mesh of {self.size} devices")
        out = []
        for p in reversed(self.shape):
            out.append(rank % p)
            rank //= p
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        r = 0
        for c, p in zip(coords, self.shape):
            r = r * p + c
        return r

    def axis_group(self, rank: int, axis: int) -> list[int]:
        """Ranks of the axis-``axis`` group containing ``rank``, ordered by coordinate."""
        c = list(self.coords(rank))
        out = []
        for k in range(self.shape[axis]):
            c[axis] = k
            out.append(self.rank(tuple(c)))
        return out

    def axis_groups(self, axis: int) -> list[list[int]]:
        """All groups of one axis, in a fixed order (every rank must create them alike): row-major in the other
        axes' coordinates, the order in which increasing ranks first meet them."""
        ranks = np.arange(self.size).reshape(self.shape)
        return np.moveaxis(ranks, axis, -1).reshape(-1, self.shape[axis]).tolist()

    def __str__(self) -> str:
        return "x".join(str(p) for p in self.shape)

    @staticmethod
    def parse(text: str) -> Mesh:
        """``"2x4"`` -> ``Mesh((2, 4))``."""
        try:
            return Mesh(tuple(int(t) for t in text.lower().split("x")))
        except ValueError as e:
            raise ValueError(f"bad mesh {text!r}: write it like 8 or 2x4 ({e})") from None


def factorizations(p: int, max_axes: int = 3) -> list[Mesh]:
    """Every ordered factorisation of ``p`` into 1..max_axes factors > 1 (``p`` itself first).

    8 -> 8, 2x4, 4x2, 2x2x2.  ``p == 1`` gives the single mesh ``(1,)``.
    """
    if p == 1:
        return [Mesh((1,))]
    out: list[tuple[int, ...]] = []

    def rec(rest: int, prefix: tuple[int, ...]) -> None:
        if rest == 1:
            if prefix:
                out.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                rec(rest // f, prefix + (f,))

    rec(p, ())
    out.sort(key=lambda s: (len(s), s))
    return [Mesh(s) for s in out]


def all_coords(mesh: Mesh) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(p) for p in mesh.shape)))
