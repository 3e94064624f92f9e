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
  as one neighbour exchange per pass; causal, also in the zig-zag layout (``"ring_zigzag"``: q, k, v moved there
  and the results back, the work even); never alone (the softmax normalises over it);
* linear in ``v``: v ``P``, q, k, mask ``R`` -> out ``P`` (not with dropout,
  whose per-device masks would differ).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..ir.accumulation import widened
from ..ir.attention import (
    RING,
    RING_ZIGZAG,
    SDPA,
    SDPA_ROWS,
    ZIGZAG,
    causal_fraction,
    causal_skew,
    zigzag_leaving,
    zigzag_rows,
    zigzag_skew,
)
from ..tiling import chunk_lengths, max_local_numel
from ._common import Args, R, Shard, bcast, partial_strategies
from .base import OpCall, OpCost, OpSpec, Strategy, Strategy1D, register


def sdpa_flops(op: OpSpec) -> float:
    """``Q K^T`` and ``P V``: ``2 * 2 * |Q| * L_k`` (the softmax's share is negligible); causal without a mask,
    only the share below the diagonal (``causal_fraction``: the fused kernels skip the rest)."""
    q, k = op.inputs[0], op.inputs[1]
    a = Args(op)
    share = causal_fraction(q.shape[-2], k.shape[-2]) if a["is_causal"] and a.spec("attn_mask") is None else 1.0
    return 4.0 * math.prod(q.shape) * k.shape[-2] * share


def row_axes(op: OpSpec, st: Strategy) -> tuple[int, ...]:
    """The mesh axes splitting an attention op's query rows (dim ``-2`` of its query) under ``st``."""
    rows = len(op.inputs[0].shape) - 2
    return tuple(a for a, pl in enumerate(st.inputs[0]) if isinstance(pl, Shard) and pl.dim == rows)


def cp_method(op: OpSpec, st: Strategy) -> str:
    """How ``st`` gives an attention op split along the query rows its keys and values: ``ring`` (split too,
    passed around) or ``all_gather_kv`` (whole, gathered by their edges); ``""`` when the rows are whole."""
    return "" if not row_axes(op, st) else RING if st.variant in (RING, RING_ZIGZAG) else "all_gather_kv"


def zigzag_layout(st: Strategy) -> bool:
    """Does ``st`` compute the rows in the zig-zag layout?"""
    return st.variant in (ZIGZAG, RING_ZIGZAG)


def _causal_row_axes(op: OpSpec, st: Strategy) -> tuple[int, ...]:
    """``row_axes`` of a causal attention (none without ``is_causal``: its tiles need no offset)."""
    return row_axes(op, st) if Args(op)["is_causal"] else ()


def sdpa_sync_args(op: OpSpec, st: Strategy) -> dict[str, Any]:
    """A causal attention whose query rows ``st`` splits: ``row_axes`` and ``rows``, the whole sequence's length,
    with which the program offsets its causal mask (``runtime.attention``), and ``zigzag`` for that variant;
    ring attention (causal or not): ``ring`` and ``keys``, the whole key sequence's length; ``{}`` otherwise."""
    if st.variant in (RING, RING_ZIGZAG):
        return {"row_axes": row_axes(op, st), "rows": op.inputs[0].shape[-2], "ring": True,
                "keys": op.inputs[1].shape[-2], **({"zigzag": True} if st.variant == RING_ZIGZAG else {})}
    axes = _causal_row_axes(op, st)
    if not axes:
        return {}
    return {"row_axes": axes, "rows": op.inputs[0].shape[-2], **({"zigzag": True} if st.variant == ZIGZAG else {})}


def sdpa_skew(op: OpSpec, st: Strategy, mesh: Any, profile: Any) -> float:
    """Causal rows split over ``p`` ranks: the busiest rank's share of the causal work over ``1 / p`` (contiguous
    chunks, or the zig-zag layout's)."""
    axes = _causal_row_axes(op, st)
    parts = math.prod(mesh.shape[a] for a in axes)
    skew = zigzag_skew if zigzag_layout(st) else causal_skew
    return skew(op.inputs[0].shape[-2], op.inputs[1].shape[-2], parts) if axes else 1.0


def sdpa_comm(op: OpSpec, st: Strategy, grads: list[bool], mesh: Any, imbalance: float = 1.0) -> list[OpCall]:
    """The collectives inside an attention op split along the sequence on axis ``a`` of ``p`` members, in program
    order (forward, then backward in autograd's order when an input needs a gradient):

    * zig-zag rows: the query rows out and the results back by all-to-alls; backward the results' gradients out and
      the queries' back (if wanted).  Each moves at most ``zigzag_leaving`` rows in or out of a member; the cost
      model's all-to-all sends ``(p - 1) / p`` of its message, so the message is that many rows' bytes times
      ``p / (p - 1)``;
    * ring (``runtime.ring``): each pass a message to one neighbour (``halo``: ``m`` bytes from one member),
      the longest block's bytes.  Forward ``p - 1`` passes of a key and value block, each during one block's
      compute (``behind``: ``1 / p`` of the op's forward); backward ``p - 1`` such passes, each during one block's
      backward (``BACKWARD / p`` of its forward), each followed by the block's key and value gradients (in the
      accumulation type: float32 for half types), and one more pass of the gradients home;
    * ring in the zig-zag layout: the queries, keys and values moved there, the ring over the zig-zag blocks, the
      results moved back; backward the results' gradients there, the ring's, then the values', keys' and queries'
      gradients home."""
    axes = row_axes(op, st)
    if not axes or not (zigzag_layout(st) or st.variant == RING) or mesh.shape[axes[0]] == 1:
        return []  # (one member keeps its rows: nothing moves)
    (a,) = axes
    p, rows = mesh.shape[a], op.inputs[0].shape[-2]
    if st.variant == RING:
        return _ring_passes(op, st, grads, mesh, a, max(chunk_lengths(op.inputs[1].shape[-2], p)))
    moved = zigzag_leaving(rows, p) * p / (p - 1)  # rows, as the message the all-to-all's pricing wants
    q, k, v, out = (OpCall("all_to_all", a, moved * _row_bytes(op, st, i, a, mesh), 1) for i in range(4))
    if st.variant == ZIGZAG:
        calls = [q, out]
        if any(grads):  # the results' gradients come back whatever needs them; the queries' only if they need one
            calls.append(out)
        if grads and grads[0]:
            calls.append(q)
        return calls
    block = max(sum(e - b for b, e in zigzag_rows(rows, p, m)) for m in range(p))
    ring = _ring_passes(op, st, grads, mesh, a, block)
    calls = [q, k, v, *ring[:p - 1], out]
    if any(grads):
        calls += [out, *ring[p - 1:], v, k, q]
    return calls


def _row_bytes(op: OpSpec, st: Strategy, i: int, axis: int, mesh: Any) -> float:
    """Bytes of one sequence row (dim ``-2``) of the tile of input ``i`` (``3``: the output, its rows as the query's,
    its last dim the value's), the split on ``axis`` left aside."""
    t = op.outputs[0] if i == 3 else op.inputs[i]
    tiling = list(st.outputs[0] if i == 3 else st.inputs[i])
    tiling[axis] = R
    return float(max_local_numel(t.shape[:-2] + (1, t.shape[-1]), tuple(tiling), mesh) * t.dtype.itemsize)


def _ring_passes(op: OpSpec, st: Strategy, grads: list[bool], mesh: Any, axis: int, block: int) -> list[OpCall]:
    """The ring's passes on ``axis`` of key/value blocks of at most ``block`` rows (``sdpa_comm``)."""
    p = mesh.shape[axis]
    kv = block * (_row_bytes(op, st, 1, axis, mesh) + _row_bytes(op, st, 2, axis, mesh))
    dtype = op.inputs[1].dtype
    grad_kv = kv * widened(dtype).itemsize / dtype.itemsize  # the gradients travel in the accumulation type
    out = [OpCall("halo", axis, kv, 1, 1 / p)] * (p - 1)
    if any(grads):
        out += [OpCall("halo", axis, kv, 1, BACKWARD / p), OpCall("halo", axis, grad_kv, 1)] * (p - 1)
        out += [OpCall("halo", axis, grad_kv, 1)]
    return out


BACKWARD = 2.5  # attention's backward in forward-equivalents (the fused kernels': recompute P, then dQ, dK, dV)


@register(SDPA, family="attention",
          cost=OpCost(flops=sdpa_flops, backward=BACKWARD, skew=sdpa_skew), sync_args=sdpa_sync_args,
          sync_call=SDPA_ROWS, comm=sdpa_comm)
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
        if a["is_causal"]:
            found.append(dataclasses.replace(found[-1], variant=RING_ZIGZAG))
    if not a["dropout_p"]:
        found += partial_strategies(a, [["value"]])
    return found

