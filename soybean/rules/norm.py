"""Normalisation layers: batch, layer, RMS and group norm.

Each normalises over some dims with statistics computed there, then applies a
per-feature affine map.  A dim may be sharded only if no statistic spans it:

* ``layer_norm``/``rms_norm`` over the trailing ``normalized_shape``: every
  leading dim; weight and bias (shape ``normalized_shape``) stay ``R``;
* ``group_norm`` (statistics over channels-in-a-group x spatial): batch only;
* ``_weight_norm`` (``g * v / ||v||``, the norm over every dim but ``dim``): ``dim`` only;
* ``batch_norm`` (statistics over every dim but channels ``1``): channels, with
  weight, bias and running stats ``S(0)`` — the in-place running-stat update
  is per channel too.  Batch or spatial splits: in eval mode with running stats
  (a per-channel affine map) as they are; in training the per-channel sums are
  added across the split axes (``sync_args``; the program runs
  ``runtime.syncnorm.sb_batch_norm``, SyncBatchNorm's maths, exact to rounding),
  weight, bias and running stats ``R``.

None is linear (mean subtraction, scaling by a data-dependent std): no ``P``.
"""
from __future__ import annotations

import math
from typing import Any

from ..ir.syncnorm import SYNC_BATCH_NORM, stats_bytes
from ..tiling import max_local_numel
from ._common import Args, R, Shard
from .base import ELEMENTWISE, OpCall, OpSpec, Strategy, Strategy1D, register


@register("aten.layer_norm.default", "aten.rms_norm.default", family="norm", cost=ELEMENTWISE)
def layer_norm(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.spec("input")
    assert x is not None
    lead = x.ndim - len(a["normalized_shape"])
    return [a.strategy({"input": Shard(d), "weight": R, "bias": R}, Shard(d)) for d in range(lead)]


@register("aten._weight_norm.default", family="norm", cost=ELEMENTWISE)
def weight_norm(op: OpSpec) -> list[Strategy1D]:
    """``w = g * v / ||v||`` with the norm over every dim but ``dim`` (``g`` has ``v``'s length there and 1
    elsewhere): only ``dim`` splits, on ``v``, ``g`` and ``w`` alike."""
    a = Args(op)
    v = a.tensor("v")
    dim = a["dim"]
    if not -v.ndim <= dim < v.ndim:  # dim=-1 of the old API: one norm over everything
        return []
    d = dim % v.ndim
    return [a.strategy({"v": Shard(d), "g": Shard(d)}, Shard(d))]


@register("aten.group_norm.default", family="norm", cost=ELEMENTWISE)
def group_norm(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    return [a.strategy({"input": Shard(0)}, Shard(0))]


_BN_PARAMS = ("weight", "bias", "running_mean", "running_var")


def batch_norm_sync_args(op: OpSpec, st: Strategy) -> dict[str, Any]:
    """In training, ``axes``: those splitting the input along a non-channel dim (its statistics sum there),
    and ``count``: the whole input's elements per channel."""
    if not Args(op)["training"]:
        return {}
    axes = tuple(axis for axis, pl in enumerate(st.inputs[0]) if isinstance(pl, Shard) and pl.dim != 1)
    shape = op.inputs[0].shape
    return {"axes": axes, "count": math.prod(shape) // shape[1]} if axes else {}


def batch_norm_writes(op: OpSpec) -> tuple[str, ...]:
    """In training, batch norm updates its running statistics in place (its schema does not say so)."""
    return ("running_mean", "running_var") if Args(op)["training"] else ()


def batch_norm_comm(op: OpSpec, st: Strategy, grads: list[bool], mesh: Any, imbalance: float = 1.0) -> list[OpCall]:
    """One all-reduce of the statistics of my channels (``ir.syncnorm.stats_bytes``) per axis summing them, forward,
    and one backward when the input needs a gradient."""
    x = op.inputs[0]
    channels = max_local_numel((x.shape[1],), tuple(Shard(0) if pl == Shard(1) else R for pl in st.inputs[0]),
                               mesh)  # my channels: dim 1's split, read as dim 0's
    return [OpCall("all_reduce", axis, float(stats_bytes(channels, x.dtype)), 1)
            for axis in batch_norm_sync_args(op, st).get("axes", ()) if mesh.shape[axis] > 1
            for _ in range(2 if grads[0] else 1)]


@register("aten.batch_norm.default", family="norm", cost=ELEMENTWISE, sync_args=batch_norm_sync_args,
          sync_call=SYNC_BATCH_NORM, writes=batch_norm_writes, comm=batch_norm_comm)
def batch_norm(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.spec("input")
    assert x is not None
    found = [a.strategy({"input": Shard(1), **{p: Shard(0) for p in _BN_PARAMS}}, Shard(1))]
    if a["training"] or (a.spec("running_mean") and a.spec("running_var")):
        found += [a.strategy({"input": Shard(d)}, Shard(d)) for d in range(x.ndim) if d != 1]
    return found
