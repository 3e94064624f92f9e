"""Memory: bytes per device that a tensor's tiling keeps.

A parameter keeps ``PARAM_COPIES`` copies of its local tile (itself, its gradient and AdamW's two
states); any other tensor, its local tile.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..mesh import Mesh
from ..rules.base import OpSpec, Strategy
from ..tiling import max_local_numel

# Adam/AdamW keep two states per parameter, plus the gradient: 4 copies in all.
PARAM_COPIES = 4


def stored_bytes(
    shape: tuple[int, ...], itemsize: int, tilings: Sequence[tuple], mesh: Mesh, copies: int
) -> np.ndarray:
    """Bytes per device of a stored tensor under each tiling, ``copies`` times (``PARAM_COPIES`` for a parameter)."""
    return np.array([max_local_numel(shape, t, mesh) * itemsize * copies for t in tilings], dtype=float)


def output_bytes(op: OpSpec, strategies: Sequence[Strategy], mesh: Mesh) -> np.ndarray:
    """Bytes per device of ``op``'s outputs under each strategy."""
    return np.array([sum(max_local_numel(o.shape, t, mesh) * o.dtype.itemsize for o, t in zip(op.outputs, s.outputs))
                     for s in strategies], dtype=float)
