"""Softmax and log-softmax along one dim.

``out[..., i, ...] = exp(x_i) / sum_j exp(x_j)`` normalises along ``dim`` only,
so any other dim may be sharded (input and output alike).  The normalised dim
needs a global max/sum: never split.  Not linear: no ``P``.
"""
from __future__ import annotations

from ._common import Args, Shard
from .base import ELEMENTWISE, OpSpec, Strategy1D, register


@register(
    "aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default",
    family="softmax", cost=ELEMENTWISE,
)
def softmax(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    return [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d != dim]
