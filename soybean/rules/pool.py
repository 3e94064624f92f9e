"""Pooling over the trailing spatial dims (max, average, adaptive).

A pool of rank ``k`` maps each ``(..., H, W)`` plane independently, so every
dim but the last ``k`` (batch, channels) may be sharded on input and outputs
(``max_pool*_with_indices``/``adaptive_max_pool2d`` indices are positions
inside a plane, unchanged by such a split).  Average pools are linear, so
``P`` -> ``P``; max pools are not.  Spatial dims would need halos: not split.
"""
from __future__ import annotations

from ._common import Args, Shard, partial_strategies
from .base import ELEMENTWISE, OpSpec, Strategy1D, register

# op -> (spatial rank, linear?)
TABLE: dict[str, tuple[int, bool]] = {
    "aten.max_pool1d.default": (1, False),
    "aten.max_pool2d.default": (2, False),
    "aten.max_pool3d.default": (3, False),
    "aten.max_pool2d_with_indices.default": (2, False),
    "aten.adaptive_max_pool2d.default": (2, False),
    "aten.avg_pool1d.default": (1, True),
    "aten.avg_pool2d.default": (2, True),
    "aten.avg_pool3d.default": (3, True),
    "aten.adaptive_avg_pool1d.default": (1, True),
    "aten.adaptive_avg_pool2d.default": (2, True),
    "aten._adaptive_avg_pool2d.default": (2, True),
}


def pool(op: OpSpec) -> list[Strategy1D]:
    rank, linear = TABLE[op.name]
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim - rank)]
    return found + (partial_strategies(a, [["self"]]) if linear else [])


register(*TABLE, family="pool", cost=ELEMENTWISE)(pool)
