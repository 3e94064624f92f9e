"""``broadcast_tensors``: every output has the broadcast shape.

Output dim ``d`` (right-aligned) may be sharded when every input that carries
``d`` with the full size is sharded on its own aligned dim; inputs where ``d``
is broadcast (size 1 or absent) stay replicated.  Local tiles then broadcast to
the local chunk of the output.
"""
from __future__ import annotations

from ..tiling import Placement, R, Shard
from .base import VIEW, OpSpec, Strategy1D, register


@register("aten.broadcast_tensors.default", family="broadcast", cost=VIEW)
def broadcast_tensors(op: OpSpec) -> list[Strategy1D]:
    if not op.outputs:
        return []
    shape = op.outputs[0].shape
    nd = len(shape)
    out = []
    for d in range(nd):
        ins: list[Placement] = []
        for spec in op.inputs:
            k = d - (nd - spec.ndim)  # the input's aligned dim
            if k >= 0 and spec.shape[k] == shape[d] and shape[d] > 1:
                ins.append(Shard(k))
            else:
                ins.append(R)
        if any(p != R for p in ins):
            out.append(Strategy1D(tuple(ins), tuple(Shard(d) for _ in op.outputs)))
    return out
