"""Normalisation layers: batch, layer, RMS and group norm.

Each normalises over some dims with statistics computed there, then applies a
per-feature affine map.  A dim may be sharded only if no statistic spans it:

* ``layer_norm``/``rms_norm`` over the trailing ``normalized_shape``: every
  leading dim; weight and bias (shape ``normalized_shape``) stay ``R``;
* ``group_norm`` (statistics over channels-in-a-group x spatial): batch only;
* ``batch_norm`` (statistics over every dim but channels ``1``): channels, with
  weight, bias and running stats ``S(0)`` — the in-place running-stat update
  is per channel too.  Batch or spatial splits change training statistics, so
  they are listed only in eval mode with running stats (a per-channel affine map).

None is linear (mean subtraction, scaling by a data-dependent std): no ``P``.
"""
from __future__ import annotations

from ._common import Args, R, Shard
from .base import ELEMENTWISE, OpSpec, Strategy1D, register


@register("aten.layer_norm.default", "aten.rms_norm.default", family="norm", cost=ELEMENTWISE)
def layer_norm(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.spec("input")
    assert x is not None
    lead = x.ndim - len(a["normalized_shape"])
    return [a.strategy({"input": Shard(d), "weight": R, "bias": R}, Shard(d)) for d in range(lead)]


@register("aten.group_norm.default", family="norm", cost=ELEMENTWISE)
def group_norm(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    return [a.strategy({"input": Shard(0)}, Shard(0))]


_BN_PARAMS = ("weight", "bias", "running_mean", "running_var")


@register("aten.batch_norm.default", family="norm", cost=ELEMENTWISE)
def batch_norm(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.spec("input")
    assert x is not None
    found = [a.strategy({"input": Shard(1), **{p: Shard(0) for p in _BN_PARAMS}}, Shard(1))]
    if not a["training"] and a.spec("running_mean") and a.spec("running_var"):
        found += [a.strategy({"input": Shard(d)}, Shard(d)) for d in range(x.ndim) if d != 1]
    return found
