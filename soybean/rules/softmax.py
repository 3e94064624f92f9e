"""Ops along one dim: softmax, log-softmax and the gated linear unit.

``out[..., i, ...] = exp(x_i) / sum_j exp(x_j)`` normalises along ``dim`` only,
so any other dim may be sharded (input and output alike).  The normalised dim
needs a global max/sum: never split.  Not linear: no ``P``.

``glu(x, dim) = a * sigmoid(b)`` with ``a, b`` the first and second halves of ``x`` along ``dim``: element ``i`` of
the output reads elements ``i`` and ``i + n / 2`` there, so that dim never splits (a tile would hold an ``a``
without its ``b``) and every other one does.  Not linear (a product of its input's halves): no ``P``.
"""
from __future__ import annotations

from ._common import Args, Shard
from .base import ELEMENTWISE, OpSpec, Strategy1D, register


@register(
    "aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default",
    "aten.glu.default", family="softmax", cost=ELEMENTWISE,
)
def softmax(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    return [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d != dim]

