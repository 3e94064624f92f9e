"""Routed experts (``soybean::routed_experts``, ``ir.experts``): data and expert parallelism.

The op is a token-wise map (``ir.experts``), so on one mesh axis:

* tokens split (``x``, ``idx``, ``w``: ``S(0)``), experts whole (``R``): each rank runs its tokens through every
  expert (data parallelism; the experts' gradients are partial sums, synchronised as any replicated weight's);
* tokens and experts split (``S(0)`` both): each (token, choice) row goes to the rank holding its expert by an
  all-to-all, comes back by the inverse one (expert parallelism; ``runtime.experts``);
* tokens whole, experts split: each rank computes the rows of its own experts; the output is a pending sum
  (``P``), and the tokens' gradients too.

Every expert weight's dim 0 is the experts.  The rank that holds expert ``e`` is the one whose tile of dim 0
holds it (``tiling``'s chunks, axis by axis).  ``experts_sync_args`` names the axes the program moves rows on
and those it leaves a pending sum on; ``experts_comm`` prices the moves as the program runs them
(``runtime.experts``): per axis of ``p`` members, forward the counts (one int64 per member), the rows and their
experts' ids (int64) out, the results back; backward the results' gradients out and the rows' gradients back; each
all-to-all's message the local buffer (balanced routing: ``(p - 1) / p`` of it leaves;
``cost.collectives.collective``).  Rows stay as many at every move under balanced routing.
"""
from __future__ import annotations

import math
from typing import Any

from ..ir.experts import ROUTED_EXPERTS
from ..mesh import Mesh
from ..tiling import Shard, max_local_numel
from ._common import Args, P, R
from .base import OpCall, OpCost, OpSpec, Strategy, Strategy1D, register


def _flops(op: OpSpec) -> float:
    """Forward FLOPs: every (token, choice) row through its expert's matmuls, ``2 a b`` per weight of
    ``(experts, a, b)`` (a bias of ``(experts, b)``: ``2 b``, a slight overcount)."""
    x, idx, *weights = op.inputs
    experts = weights[0].shape[0] if weights else 1
    return float(x.shape[0] * idx.shape[1] * sum(2 * math.prod(t.shape) / experts for t in weights))


def expert_axes(st: Strategy) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(axes that split the experts, those of them that split the tokens too)."""
    x, weights = st.inputs[0], st.inputs[3:]
    shard = tuple(a for a in range(len(x)) if weights and isinstance(weights[0][a], Shard))
    return shard, tuple(a for a in shard if isinstance(x[a], Shard))


def experts_sync_args(op: OpSpec, st: Strategy) -> dict[str, Any]:
    """``{}`` when the experts are whole on every axis (the op runs on its tiles alone); else ``shard``, the axes
    splitting the experts, and ``a2a``, those of them the rows move on (the others leave a pending sum)."""
    shard, a2a = expert_axes(st)
    return {"shard": shard, "a2a": a2a} if shard else {}


def experts_comm(op: OpSpec, st: Strategy, grads: list[bool], mesh: Mesh, imbalance: float = 1.0) -> list[OpCall]:
    """The all-to-alls of ``experts_sync_args``' ``a2a`` axes (module docstring), in program order; the rows a move
    carries ``imbalance`` times the balanced share (the busiest rank's: it sets the collective's time)."""
    shard, a2a = expert_axes(st)
    if not a2a:
        return []
    x, idx = op.inputs[0], op.inputs[1]
    leave = math.prod(mesh.shape[a] for a in shard if a not in a2a)  # rows another partial group computes
    rows = max_local_numel(x.shape[:1], st.inputs[0], mesh) * idx.shape[1] / leave * imbalance  # tokens: S(0) or R
    row_bytes = x.shape[1] * x.dtype.itemsize
    out: list[OpCall] = []
    for a in a2a:  # forward: the counts, the rows and their experts' ids (int64) out, the results back
        out += [OpCall("all_to_all", a, 8.0 * mesh.shape[a], 1), OpCall("all_to_all", a, rows * row_bytes, 1),
                OpCall("all_to_all", a, rows * 8.0, 1)]
    out += [OpCall("all_to_all", a, rows * row_bytes, 1) for a in reversed(a2a)]
    if any(grads):  # backward: the results' gradients out, the rows' gradients back
        out += [OpCall("all_to_all", a, rows * row_bytes, 1) for a in a2a]
        out += [OpCall("all_to_all", a, rows * row_bytes, 1) for a in reversed(a2a)]
    return out


def experts_skew(op: OpSpec, st: Strategy, mesh: Mesh, profile: Any) -> float:
    """Where ``st`` splits the experts each rank's work follows the routing: the busiest rank's is
    ``Profile.expert_imbalance`` times the balanced share."""
    return float(profile.expert_imbalance) if expert_axes(st)[0] else 1.0


@register("soybean.routed_experts.default", family="experts",
          cost=OpCost(flops=_flops, backward=2.0, skew=experts_skew),
          sync_args=experts_sync_args, sync_call=ROUTED_EXPERTS, comm=experts_comm)
def routed_experts(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    tokens = {"x": Shard(0), "idx": Shard(0), "w": Shard(0)}
    return [a.strategy(tokens, Shard(0)),
            a.strategy({**tokens, "params": Shard(0)}, Shard(0)),
            a.strategy({"x": R, "idx": R, "w": R, "params": Shard(0)}, P)]

