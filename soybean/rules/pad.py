"""Padding: ``aten.pad`` (constant, reflect, replicate, circular) and ``constant_pad_nd``.

``pad`` lists ``(before, after)`` pairs from the last dim backwards; only those dims
change, each padded from its own values (or a constant).  A dim whose pair is
``(0, 0)``, or that the list does not reach, may be sharded on input and output alike.
Linear (``P`` -> ``P``) unless a nonzero constant is added: reflect, replicate and
circular only copy elements, constant padding with 0 adds zeros.
"""
from __future__ import annotations

from ._common import Args, Shard, partial_strategies
from .base import ELEMENTWISE, OpSpec, Strategy1D, register


def _padded_dims(ndim: int, pad: list[int]) -> set[int]:
    return {ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}


@register("aten.pad.default", "aten.constant_pad_nd.default", family="pad", cost=ELEMENTWISE)
def pad(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    padded = _padded_dims(x.ndim, list(a["pad"]))
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d not in padded]
    adds_constant = a["mode"] in (None, "constant") and a["value"] not in (None, 0)
    return found + ([] if adds_constant else partial_strategies(a, [["self"]]))
