"""Scaled dot-product attention.

``out[..., l, :] = softmax(q[..., l, :] k[..., :, :]^T * scale + mask[..., l, :]) v``
with q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)`` and a mask
broadcastable to ``(..., L, S)``.  Exact one-axis strategies:

* a batch/head dim (every dim but the last two) carried by q, k and v alike:
  shard it on q, k, v, out (the mask by broadcasting).  Heads of different
  counts (GQA) are not sharded;
* the query sequence ``L`` without ``is_causal`` (rows are independent; the
  causal mask would be rebuilt from local row 0, so it is skipped): q and out
  sharded, k, v ``R``, the mask sharded on its ``L`` dim when it has one;
* never the key sequence ``S`` (the softmax normalises over it);
* linear in ``v``: v ``P``, q, k, mask ``R`` -> out ``P`` (not with dropout,
  whose per-device masks would differ).
"""
from __future__ import annotations

import math

from ._common import Args, Shard, bcast, partial_strategies
from .base import OpCost, OpSpec, Strategy1D, register


def sdpa_flops(op: OpSpec) -> float:
    """``Q K^T`` and ``P V``: ``2 * 2 * |Q| * L_k`` (the softmax's share is negligible)."""
    q, k = op.inputs[0], op.inputs[1]
    return 4.0 * math.prod(q.shape) * k.shape[-2]


@register("aten.scaled_dot_product_attention.default", family="attention", cost=OpCost(flops=sdpa_flops, backward=2.5))
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
        if q.shape[d] == k.shape[d] == v.shape[d]:
            roles = {"query": Shard(d), "key": Shard(d), "value": Shard(d), "attn_mask": bcast(mask, scores, d)}
            found.append(a.strategy(roles, Shard(d)))
    if not a["is_causal"]:
        found.append(a.strategy({"query": Shard(nd - 2), "attn_mask": bcast(mask, scores, nd - 2)}, Shard(nd - 2)))
    if not a["dropout_p"]:
        found += partial_strategies(a, [["value"]])
    return found

