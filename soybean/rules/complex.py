"""Complex views: ``view_as_complex`` (a float ``(..., 2)`` tensor seen as complex ``(...)``) and its inverse
``view_as_real``.

The trailing pair of real and imaginary parts is never split (a device would hold half of a number):
every other dim keeps its number on both sides.  Both are linear over the reals: ``P -> P`` (a pending sum
of complex numbers is the pending sums of their parts).  Rotary embeddings written with complex
multiplication (Llama's reference code, torchtitan's ``apply_rotary_emb``) view queries and keys this way.
"""
from __future__ import annotations

from ._common import Args, Shard, partial_strategies
from .base import VIEW, OpSpec, Strategy1D, register


@register("aten.view_as_complex.default", family="complex", cost=VIEW)
def view_as_complex(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim - 1)]
    return found + partial_strategies(a, [["self"]])


@register("aten.view_as_real.default", family="complex", cost=VIEW)
def view_as_real(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim)]
    return found + partial_strategies(a, [["self"]])
