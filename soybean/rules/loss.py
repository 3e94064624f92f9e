"""Losses: cross-entropy, NLL, MSE.

Per-sample loss ``l_i`` depends only on sample ``i`` (all its classes), so

* ``reduction='none'``: shard any non-class dim of the input, the target's
  matching dim, and the output's matching dim;
* ``reduction='sum'``: the same input/target split gives local sums: out ``P``
  (``nll_loss_forward``'s ``total_weight`` = sum of target weights: ``P`` too);
* ``reduction='mean'``: nothing — a mean of local means is wrong for uneven
  splits and class weights / ``ignore_index`` change the denominator;
* the class dim: never (log-softmax over classes, target lookup across classes).

``nll_loss`` is linear in its input (``-w[y] x[i, y]``, the mean's denominator
only depends on target and weight): input ``P``, target/weight ``R`` -> out
``P`` for every reduction (``total_weight`` ``R``).  Cross-entropy and MSE are
not linear.  Integer targets are never ``P``.
"""
from __future__ import annotations

from ..tiling import Placement
from ._common import Args, P, R, Shard, partial_strategies
from .base import ELEMENTWISE, OpSpec, Strategy1D, register

NONE, MEAN, SUM = 0, 1, 2


def per_sample(a: Args, input_name: str = "self") -> list[Strategy1D]:
    """Batch/spatial splits for ``reduction`` none or sum (``target`` ints or class probabilities)."""
    x, t = a.spec(input_name), a.spec("target")
    assert x is not None and t is not None
    red = a["reduction"]
    if red not in (NONE, SUM) or x.ndim < 2:
        return []
    probs = t.shape == x.shape  # class-probability target: same layout as the input
    found: list[Strategy1D] = []
    for d in range(x.ndim):
        if d == 1:
            continue
        td = d if (probs or d == 0) else d - 1
        outs: list[Placement] = [Shard(td) if red == NONE else P]
        if len(a.op.outputs) == 2:  # nll_loss_forward: (output, total_weight)
            outs.append(R if red == NONE else P)
        found.append(a.strategy({input_name: Shard(d), "target": Shard(td), "weight": R}, outs))
    return found


@register("aten.cross_entropy_loss.default", family="loss", cost=ELEMENTWISE)
def cross_entropy(op: OpSpec) -> list[Strategy1D]:
    return per_sample(Args(op))


@register(
    "aten.nll_loss.default", "aten.nll_loss_nd.default", "aten.nll_loss_forward.default",
    "aten.nll_loss2d_forward.default",
    family="loss", cost=ELEMENTWISE,
)
def nll_loss(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    lin = partial_strategies(a, [["self"]])
    if len(op.outputs) == 2:  # total_weight does not depend on the input: R
        lin = [a.strategy({"self": P}, [P, R]) for _ in lin]
    return per_sample(a) + lin


@register("aten.mse_loss.default", family="loss", cost=ELEMENTWISE)
def mse_loss(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x, t = a.spec("self"), a.spec("target")
    assert x is not None and t is not None
    red = a["reduction"]
    if red not in (NONE, SUM) or x.shape != t.shape:
        return []
    return [a.strategy({"self": Shard(d), "target": Shard(d)}, Shard(d) if red == NONE else P) for d in range(x.ndim)]
