"""Losses: cross-entropy, NLL, MSE.

Per-sample loss ``l_i`` depends only on sample ``i`` (all its classes), so

* ``reduction='none'``: shard any non-class dim of the input, the target's
  matching dim, and the output's matching dim;
* ``reduction='sum'``: the same input/target split gives local sums: out ``P``
  (``nll_loss_forward``'s ``total_weight`` = sum of target weights: ``P`` too);
* ``reduction='mean'``: nothing — a mean of local means is wrong for uneven
  splits and class weights / ``ignore_index`` change the denominator;
* the class dim (cross-entropy with class indices and no label smoothing, any reduction): each row's
  log-sum-exp and target logit are combined across the members holding its classes (``ir.loss_parallel``; the
  program calls ``runtime.vocab_loss.sb_cross_entropy``, ``sync_args``: the class axes), so every member
  holds the whole loss: target and weight ``R``, out ``R`` (torchtitan's loss parallelism, which keeps
  a large vocabulary's logits split from the output projection through the loss).  Never otherwise
  (log-softmax over classes, target lookup across classes).

``nll_loss`` is linear in its input (``-w[y] x[i, y]``, the mean's denominator
only depends on target and weight): input ``P``, target/weight ``R`` -> out
``P`` for every reduction (``total_weight`` ``R``).  Cross-entropy and MSE are
not linear.  Integer targets are never ``P``.
"""
from __future__ import annotations

from typing import Any

from ..ir.loss_parallel import CLASS_SPLIT_CROSS_ENTROPY, gathered_bytes
from ..tiling import Placement, max_local_numel
from ._common import Args, P, R, Shard, partial_strategies
from .base import ELEMENTWISE, OpCall, OpSpec, Strategy, Strategy1D, register

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


def _class_split(a: Args) -> bool:
    """Can the class dim split: class-index targets, no label smoothing (``sb_cross_entropy``'s domain)."""
    x, t = a.spec("self"), a.spec("target")
    assert x is not None and t is not None
    return x.ndim >= 2 and t.ndim == x.ndim - 1 and not a["label_smoothing"]


def class_axes(st: Strategy) -> tuple[int, ...]:
    """The mesh axes splitting the logits' class dim."""
    return tuple(axis for axis, pl in enumerate(st.inputs[0]) if pl == Shard(1))


def cross_entropy_sync_args(op: OpSpec, st: Strategy) -> dict[str, Any]:
    """``class_axes`` and the whole ``classes`` when the class dim is split, else nothing to synchronise."""
    axes = class_axes(st)
    return {"class_axes": axes, "classes": op.inputs[0].shape[1]} if axes else {}


def cross_entropy_comm(op: OpSpec, st: Strategy, grads: list[bool], mesh: Any, imbalance: float = 1.0
                       ) -> list[OpCall]:
    """Forward, one all-gather of my rows' two statistics per class axis (``ir.loss_parallel``); backward nothing."""
    t = op.inputs[1]
    rows = max_local_numel(t.shape, st.inputs[1], mesh)
    return [OpCall("all_gather", a, float(gathered_bytes(rows, mesh.shape[a], op.inputs[0].dtype)), 1)
            for a in class_axes(st) if mesh.shape[a] > 1]


@register("aten.cross_entropy_loss.default", family="loss", cost=ELEMENTWISE, sync_args=cross_entropy_sync_args,
          sync_call=CLASS_SPLIT_CROSS_ENTROPY, comm=cross_entropy_comm)
def cross_entropy(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    split = [a.strategy({"self": Shard(1), "target": R, "weight": R}, R)] if _class_split(a) else []
    return per_sample(a) + split


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
