"""Convolutions (``conv1d``/``conv2d``/``conv3d``, int or string padding).

``out[n, o, *] = bias[o] + sum_{c, taps} w[o, c, taps] * x[n, c, * + taps]``
with input ``(N, C, *spatial)`` (or unbatched ``(C, *spatial)``) and weight
``(O, C / groups, *kernel)``.  Exact one-axis strategies:

* batch: input ``S(0)``, out ``S(0)``; weight and bias ``R``;
* out channels (``groups == 1``): weight ``S(0)``, bias ``S(0)``, out ``S(c)``;
* in channels (contracted, ``groups == 1``): input ``S(c)``, weight ``S(1)``,
  bias ``P``, out ``P``;
* linear in input or in weight: that one ``P``, the other ``R``, bias ``P`` -> ``P``.

Spatial dims need halos and are not split; grouped convolutions keep their
channels whole (a chunk of channels is not a whole number of groups in general).
"""
from __future__ import annotations

import math

from ._common import Args, P, R, Shard, partial_strategies
from .base import OpCost, OpSpec, Strategy1D, register

CONVS = tuple(f"aten.conv{k}d.{o}" for k in (1, 2, 3) for o in ("default", "padding"))


def conv_flops(op: OpSpec) -> float:
    """``2 * |out| * C_in/groups * prod(kernel)``: one multiply-add per output element and weight tap."""
    return 2.0 * math.prod(op.outputs[0].shape) * math.prod(op.inputs[1].shape[1:])


@register(*CONVS, family="conv", cost=OpCost(flops=conv_flops, operands=(0, 1), conv=True))
def conv(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x, w = a.spec("input"), a.spec("weight")
    assert x is not None and w is not None
    batched = x.ndim == w.ndim
    c = 1 if batched else 0
    found: list[Strategy1D] = []
    if batched:
        found.append(a.strategy({"input": Shard(0), "weight": R, "bias": R}, Shard(0)))
    if a["groups"] in (None, 1):
        found.append(a.strategy({"weight": Shard(0), "bias": Shard(0)}, Shard(c)))
        if op.outputs[0].dtype.is_floating_point:
            found.append(a.strategy({"input": Shard(c), "weight": Shard(1), "bias": P}, P))
    return found + partial_strategies(a, [["input", "bias"], ["weight", "bias"]])
