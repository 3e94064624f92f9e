"""Factories (``zeros``, ``ones``, ``full``, ``empty``, ``new_*``, ``*_like``, ``arange``) and
the triangular masks ``tril``/``triu``.

A constant tensor can be created directly in any sharding: each device builds
its local tile (``localize`` rewrites ``size`` to the local output shape).
``zeros`` is also a valid ``P`` (every summand zero).  ``new_*`` ops only read
``self``'s dtype/device, so ``self`` may be placed anyhow; ``*_like`` ops take
their shape from ``self``, so the output follows ``self``'s sharding (a ``P``
``self`` gives an ``R`` constant).

``arange`` has no split strategy: a local tile needs its global offset, which
``localize`` (given only local shapes) cannot know; it is registered so the
planner knows it is replicated on purpose.

``tril``/``triu`` mask by ``col - row`` of the last two dims: leading (batch)
dims may be sharded; the matrix dims would shift the diagonal.  Linear.
"""
from __future__ import annotations

from ._common import Args, P, R, Shard, free_placements, outputs_float, partial_strategies, size_localizer
from .base import ELEMENTWISE, OpSpec, Strategy1D, register


def _constant_is_zero(a: Args) -> bool:
    name = a.op.name
    if "zeros" in name:
        return True
    return "full" in name and a["fill_value"] == 0


def created(op: OpSpec) -> list[Strategy1D]:
    """Output in any sharding (or ``P`` for zeros); ``self`` (``new_*``) in any placement."""
    a = Args(op)
    out = op.outputs[0]
    # A dim of length 0 (an empty KV cache's) has nothing to split.
    outs = [Shard(d) for d in range(out.ndim) if out.shape[d]] + ([P] if _constant_is_zero(a) and outputs_float(op)
                                                                   else [])
    selves = free_placements(a.spec("self")) if a.spec("self") else [R]
    return [a.strategy({"self": s}, o) for s in selves for o in [R, *outs] if not (s == R and o == R)]


register(
    "aten.zeros.default", "aten.ones.default", "aten.full.default", "aten.empty.memory_format",
    "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default", "aten.new_empty.default",
    localize=size_localizer("size"), family="factory", cost=ELEMENTWISE,
)(created)


@register(
    "aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default",
    family="factory", cost=ELEMENTWISE,
)
def like(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim)]
    if a.all_float("self"):
        found.append(a.strategy({"self": P}, R))
    return found


@register("aten.arange.default", "aten.arange.start", "aten.arange.start_step", family="factory", cost=ELEMENTWISE)
def arange(op: OpSpec) -> list[Strategy1D]:
    return []


@register("aten.tril.default", "aten.triu.default", family="factory", cost=ELEMENTWISE)
def triangle(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim - 2)]
    return found + partial_strategies(a, [["self"]])
