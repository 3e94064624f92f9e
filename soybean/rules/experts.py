"""Routed experts (``soybean::routed_experts``, ``ir.experts``): data and expert parallelism.

The op is a token-wise map (``ir.experts``), so on one mesh axis:

* tokens split (``x``, ``idx``, ``w``: ``S(0)``), experts whole (``R``): each rank runs its tokens through every
  expert (data parallelism; the experts' gradients are partial sums, synchronised as any replicated weight's);
* tokens and experts split (``S(0)`` both): each (token, choice) row goes to the rank holding its expert by an
  all-to-all, comes back by the inverse one (expert parallelism; ``runtime.experts``);
* tokens whole, experts split: each rank computes the rows of its own experts; the output is a pending sum
  (``P``), and the tokens' gradients too;
* tokens whole, every expert split inside along its FFN dim (tensor parallelism inside the experts, Megatron's
  column- then row-split MLP per expert): each rank runs every row through its slice of every expert's hidden
  units, and the output is a pending sum (``P``).  Offered only when ``ffn_split`` proves it from the body.

Every expert weight's dim 0 is the experts.  The rank that holds expert ``e`` is the one whose tile of dim 0
holds it (``tiling``'s chunks, axis by axis).  ``experts_sync_args`` names the axes the program moves rows on
and those it leaves a pending sum on; ``experts_comm`` prices the moves as the program runs them
(``runtime.experts``): per axis of ``p`` members, forward the counts (one int64 per member), the rows and their
experts' ids (int64) out, the results back; backward the results' gradients out and the rows' gradients back; each
all-to-all's message the local buffer (balanced routing: ``(p - 1) / p`` of it leaves;
``cost.collectives.collective``).  Rows stay as many at every move under balanced routing.
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any

from ..ir.experts import GROUPED_MM, ROUTED_EXPERTS
from ..mesh import Mesh
from ..tiling import Shard, max_local_numel
from ._common import Args, P, R
from .base import OpCall, OpCost, OpSpec, Strategy, Strategy1D, lookup, register

_PASS = ("aten::to.dtype", "aten::_to_copy.default", "aten::contiguous.default", "aten::clone.default")


@functools.lru_cache(maxsize=64)
def ffn_split(body: str, shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, bool], ...] | None:
    """Per expert weight (``shapes``: theirs, in the op's order), the dim to split and whether it is a
    packed pair's (``capture.passes.fuse_routed_experts.pack_pairs``: the stored ``(experts, 2, f, h)`` split
    along ``f``) so that the body, run on every row with each rank's slices, gives a summand of its output: None
    when that is not proven.

    Proof by propagation over the body's steps, each value tagged ``R`` (whole), ``S`` (its last dim is this
    rank's contiguous slice of the hidden units), ``B`` (its last dim is two such slices, a packed pair's: the gate's
    then the up projection's), ``P`` (a summand), or a weight with the stored dims behind each of its dims:

    * ``grouped_mm(a, w)`` with ``w`` ``(experts, K, M)``: ``a`` ``R`` splits ``M`` (``S``; ``B`` when ``M`` is a
      flattened pair ``(2, f)``, split along ``f``); ``a`` ``S`` splits ``K`` and gives ``P`` (a sum over the
      hidden units is the sum of each rank's share);
    * ``chunk(B, 2, -1)`` gives two ``S``; an elementwise op of operands all ``R`` or all ``S`` keeps the tag (the
      hidden units are independent of one another); casts and copies keep any tag;
    * the output must be ``P``, every weight split once, one way; anything else (a bias added after the last
      product, a reduction over the hidden units) is no proof."""
    spec = json.loads(body)
    tags: list[Any] = ["R", "O", "I"] + [("W", i, tuple((d,) for d in range(len(sh)))) for i, sh in enumerate(shapes)]
    split: dict[int, tuple[int, bool]] = {}

    def ref(a: Any) -> Any:
        return tags[a["ref"]] if isinstance(a, dict) and "ref" in a else None

    def assign(i: int, dim: int, pair: bool) -> bool:
        return split.setdefault(i, (dim, pair)) == (dim, pair)

    for target, args, _kwargs in spec["steps"]:
        first = ref(args[0]) if args else None
        tensors = [t for t in (ref(a) for a in args) if t is not None]
        got: Any = None
        if target in _PASS:
            got = first
        elif isinstance(first, tuple) and first[0] == "W" and target in ("aten::flatten.using_ints",
                                                                          "aten::transpose.int"):
            dims = list(first[2])
            a, b = (int(v) % len(dims) for v in args[1:3])
            if target == "aten::transpose.int":
                dims[a], dims[b] = dims[b], dims[a]
            else:
                dims[a:b + 1] = [sum(dims[a:b + 1], ())]
            got = ("W", first[1], tuple(dims))
        elif target.split(".")[0] in GROUPED_MM and len(args) == 3 and tensors[2:] == ["O"]:
            got = _product(first, tensors[1], shapes, assign)
        elif target == "aten::chunk.default" and first == "B" and args[1] == 2 and args[2] in (-1, 1):
            got = ("L", "S")
        elif target == "getitem" and isinstance(first, tuple) and first[0] == "L":
            got = first[1]
        elif (entry := lookup(target.replace("::", "."))) is not None and entry.family == "elementwise" and (
                len(set(tensors)) == 1 and tensors[0] in ("R", "S")):
            got = tensors[0]
        if got is None:
            return None
        tags.append(got)
    if tags[spec["out"]["ref"]] != "P" or set(split) != set(range(len(shapes))):
        return None
    return tuple(split[i] for i in range(len(shapes)))


def _product(a: Any, w: Any, shapes: tuple[tuple[int, ...], ...], assign: Any) -> Any:
    """``ffn_split``'s tag of ``grouped_mm(a, w)``: rows tagged ``a`` times a weight view ``(experts, K, M)``."""
    if not (isinstance(w, tuple) and w[0] == "W" and len(w[2]) == 3 and w[2][0] == (0,)):
        return None
    i, (_, k, m) = w[1], w[2]
    if a == "R" and len(m) == 1:  # column split: my hidden units
        return "S" if assign(i, m[0], False) else None
    if a == "R" and len(m) == 2 and shapes[i][m[0]] == 2:  # a packed pair: my units of each
        return "B" if assign(i, m[1], True) else None
    if a == "S" and len(k) == 1:  # row split: my units' share of the sum
        return "P" if assign(i, k[0], False) else None
    return None


def _flops(op: OpSpec) -> float:
    """Forward FLOPs: every (token, choice) row through its expert's matmuls, ``2 a b`` per weight of
    ``(experts, a, b)`` (a bias of ``(experts, b)``: ``2 b``, a slight overcount)."""
    x, idx, _w, *weights = op.inputs
    experts = weights[0].shape[0] if weights else 1
    return float(x.shape[0] * idx.shape[1] * sum(2 * math.prod(t.shape) / experts for t in weights))


def expert_axes(st: Strategy) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(axes that split the experts, those of them that split the tokens too)."""
    x, weights = st.inputs[0], st.inputs[3:]
    shard = tuple(a for a in range(len(x)) if weights and weights[0][a] == Shard(0))
    return shard, tuple(a for a in shard if isinstance(x[a], Shard))


def ffn_axes(st: Strategy) -> tuple[int, ...]:
    """The axes splitting every expert inside along its FFN dim (tensor parallelism inside the experts)."""
    weights = st.inputs[3:]
    return tuple(a for a in range(len(st.inputs[0])) if weights and isinstance(weights[0][a], Shard)
                 and weights[0][a] != Shard(0))


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
    out = [a.strategy(tokens, Shard(0)),
           a.strategy({**tokens, "params": Shard(0)}, Shard(0)),
           a.strategy({"x": R, "idx": R, "w": R, "params": Shard(0)}, P)]
    weights = op.inputs[3:]
    inner = ffn_split(op.args[5], tuple(tuple(w.shape) for w in weights))
    if inner is not None:
        slots = a.slots["params"]
        assert isinstance(slots, list)
        out.append(a.strategy({"x": R, "idx": R, "w": R, "params": [Shard(d) for d, _ in inner]}, P,
                              even=[(s, d) for s, (d, _) in zip(slots, inner)]))  # slices of equal units
    return out

