"""Scaled dot-product attention.

``out[..., l, :] = softmax(q[..., l, :] k[..., :, :]^T * scale + mask[..., l, :]) v``
with q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)`` and a mask
broadcastable to ``(..., L, S)``.  Exact one-axis strategies:

* a batch/head dim (every dim but the last two) carried by q, k and v alike:
  shard it on q, k, v, out (the mask by broadcasting).  Heads of different
  counts (GQA) are not sharded;
* the query sequence ``L`` (rows are independent): q and out sharded, k, v ``R``, the mask sharded on its ``L``
  dim when it has one.  With ``is_causal`` (and no mask) the local causal mask would start at local row 0, so the
  program calls ``runtime.attention.sb_sdpa_rows`` instead (``sync_args``: the axes splitting the rows and their
  count), which offsets it by the tile's first row; the rank holding the last rows works the most
  (``ir.attention.causal_skew``, priced).  Its ``"zigzag"`` variant (one mesh axis) computes the rows in the
  zig-zag layout instead, each member one early and one late chunk, the query rows moved there and the results
  back by all-to-alls inside the op (``ir.attention.zigzag_moves``, priced by ``sdpa_comm``), the work even;
* the key sequence ``S`` only with the query rows on the same axis, as ring attention (the ``"ring"`` variant: q,
  k, v and out all split along the sequence; the key/value blocks passed from member to member, the partial
  results merged by their log-sum-exp: ``runtime.ring``; causal only where ``L == S``), priced by ``sdpa_comm``
  as one neighbour exchange per pass; never alone (the softmax normalises over it);
* linear in ``v``: v ``P``, q, k, mask ``R`` -> out ``P`` (not with dropout,
  whose per-device masks would differ).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..ir.attention import RING, SDPA_ROWS, ZIGZAG, causal_skew, zigzag_leaving, zigzag_skew
from ..tiling import max_local_numel
from ._common import Args, R, Shard, bcast, partial_strategies
from .base import OpCost, OpSpec, Strategy, Strategy1D, register


def sdpa_flops(op: OpSpec) -> float:
    """``Q K^T`` and ``P V``: ``2 * 2 * |Q| * L_k`` (the softmax's share is negligible)."""
    q, k = op.inputs[0], op.inputs[1]
    return 4.0 * math.prod(q.shape) * k.shape[-2]


def row_axes(op: OpSpec, st: Strategy) -> tuple[int, ...]:
    """The mesh axes splitting an attention op's query rows (dim ``-2`` of its query) under ``st``."""
    rows = len(op.inputs[0].shape) - 2
    return tuple(a for a, pl in enumerate(st.inputs[0]) if isinstance(pl, Shard) and pl.dim == rows)


def cp_method(op: OpSpec, st: Strategy) -> str:
    """How ``st`` gives an attention op split along the query rows its keys and values: ``ring`` (split too,
    passed around) or ``all_gather_kv`` (whole, gathered by their edges); ``""`` when the rows are whole."""
    return "" if not row_axes(op, st) else RING if st.variant == RING else "all_gather_kv"


def _causal_row_axes(op: OpSpec, st: Strategy) -> tuple[int, ...]:
    """``row_axes`` of a causal attention (none without ``is_causal``: its tiles need no offset)."""
    return row_axes(op, st) if Args(op)["is_causal"] else ()


def sdpa_sync_args(op: OpSpec, st: Strategy) -> dict[str, Any]:
    """A causal attention whose query rows ``st`` splits: ``row_axes`` and ``rows``, the whole sequence's length,
    with which the program offsets its causal mask (``runtime.attention``), and ``zigzag`` for that variant;
    ring attention (causal or not): ``ring`` and ``keys``, the whole key sequence's length; ``{}`` otherwise."""
    if st.variant == RING:
        return {"row_axes": row_axes(op, st), "rows": op.inputs[0].shape[-2], "ring": True,
                "keys": op.inputs[1].shape[-2]}
    axes = _causal_row_axes(op, st)
    if not axes:
        return {}
    return {"row_axes": axes, "rows": op.inputs[0].shape[-2], **({"zigzag": True} if st.variant == ZIGZAG else {})}


def sdpa_skew(op: OpSpec, st: Strategy, mesh: Any, profile: Any) -> float:
    """Causal rows split over ``p`` ranks: the busiest rank's share of the causal work over ``1 / p`` (contiguous
    chunks, or the zig-zag layout's)."""
    axes = _causal_row_axes(op, st)
    parts = math.prod(mesh.shape[a] for a in axes)
    skew = zigzag_skew if st.variant == ZIGZAG else causal_skew
    return skew(op.inputs[0].shape[-2], op.inputs[1].shape[-2], parts) if axes else 1.0


def sdpa_comm(op: OpSpec, st: Strategy, grads: list[bool], mesh: Any, imbalance: float = 1.0
              ) -> list[tuple[str, int, float, int]]:
    """The zig-zag variant's all-to-alls on its row axis ``a`` of ``p`` members, in program order: forward the
    query rows out and the results back, backward the results' gradients out and the queries' back (if wanted).
    Each moves at most ``zigzag_leaving`` rows in or out of a member; the cost model's all-to-all sends
    ``(p - 1) / p`` of its message, so the message is that many rows' bytes times ``p / (p - 1)``.

    The ring variant's passes (``runtime.ring``), each a message to one neighbour (``halo``: ``m`` bytes from one
    member): forward ``p - 1`` of my key and value blocks; backward (when an input needs a gradient) ``p - 1`` of
    the blocks with their gradients, and one of the gradients alone; the longest block's bytes."""
    if st.variant == RING:
        return _ring_comm(op, st, grads, mesh)
    axes = _causal_row_axes(op, st)
    if st.variant != ZIGZAG or not axes:
        return []
    (a,) = axes
    q, v = op.inputs[0], op.inputs[2]
    p, rows = mesh.shape[a], q.shape[-2]
    if p == 1:  # one member keeps its rows: nothing moves
        return []
    per_row = list(st.inputs[0])
    per_row[a] = R
    one = max_local_numel(q.shape[:-2] + (1, q.shape[-1]), tuple(per_row), mesh)  # a query row's elements
    moved = zigzag_leaving(rows, p) * p / (p - 1) * q.dtype.itemsize
    q_bytes, out_bytes = moved * one, moved * one * v.shape[-1] / q.shape[-1]
    out = [("all_to_all", a, q_bytes, 1), ("all_to_all", a, out_bytes, 1)]
    if any(grads):  # the results' gradients come back whatever needs them; the queries' only if they need one
        out.append(("all_to_all", a, out_bytes, 1))
    if grads and grads[0]:
        out.append(("all_to_all", a, q_bytes, 1))
    return out


def _ring_comm(op: OpSpec, st: Strategy, grads: list[bool], mesh: Any) -> list[tuple[str, int, float, int]]:
    """``sdpa_comm`` of the ring variant."""
    (a,) = row_axes(op, st)
    p = mesh.shape[a]
    if p == 1:
        return []
    k, v = op.inputs[1], op.inputs[2]
    kv = float(max_local_numel(k.shape, st.inputs[1], mesh) * k.dtype.itemsize
               + max_local_numel(v.shape, st.inputs[2], mesh) * v.dtype.itemsize)
    out = [("halo", a, kv, 1)] * (p - 1)
    if any(grads):
        out += [("halo", a, 2 * kv, 1)] * (p - 1) + [("halo", a, kv, 1)]
    return out


@register("aten.scaled_dot_product_attention.default", family="attention",
          cost=OpCost(flops=sdpa_flops, backward=2.5, skew=sdpa_skew), sync_args=sdpa_sync_args, sync_call=SDPA_ROWS,
          comm=sdpa_comm)
def sdpa(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    q, k, v, mask = a.spec("query"), a.spec("key"), a.spec("value"), a.spec("attn_mask")
    assert q is not None and k is not None and v is not None
    if not (q.ndim == k.ndim == v.ndim):
        return []
    nd = q.ndim
    scores = q.shape[:-1] + (k.shape[-2],)  # (..., L, S): what the mask broadcasts to
    found: list[Strategy1D] = []
    for d in range(nd - 2):
        if q.shape[d] == k.shape[d] == v.shape[d] > 1:
            roles = {"query": Shard(d), "key": Shard(d), "value": Shard(d), "attn_mask": bcast(mask, scores, d)}
            found.append(a.strategy(roles, Shard(d)))
    if not a["is_causal"] or mask is None:  # causal: the program offsets the mask (``sdpa_sync_args``)
        found.append(a.strategy({"query": Shard(nd - 2), "attn_mask": bcast(mask, scores, nd - 2)}, Shard(nd - 2)))
        if a["is_causal"] and not a["dropout_p"]:
            found.append(dataclasses.replace(found[-1], variant=ZIGZAG))
    if mask is None and not a["dropout_p"] and (not a["is_causal"] or q.shape[-2] == k.shape[-2]):
        seq = Shard(nd - 2)
        found.append(dataclasses.replace(a.strategy({"query": seq, "key": seq, "value": seq}, seq), variant=RING))
    if not a["dropout_p"]:
        found += partial_strategies(a, [["value"]])
    return found

