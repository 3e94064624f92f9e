"""Ring attention: query rows, keys and values all split along the sequence on one mesh axis of ``p`` members.

Member ``r`` holds query rows ``Q_r``, keys ``K_r`` and values ``V_r``: contiguous chunks (``contiguous``) or any
rows whose global positions every member knows (the zig-zag layout's two chunks, ``runtime.attention``).
Forward, in ``p`` steps ``j = 0 .. p - 1``, it holds block ``s = r - j (mod p)``, computes its rows against it and
passes it on to member ``r + 1`` (``Group.exchange``, one neighbour: the halo pricing of ``rules.attention``),
the pass started before the block's compute and waited for after it, so that on a group that starts exchanges
(``TorchGroup.exchange_start``) the next block moves while this one computes.  Each
block gives partial results ``O_s = softmax_s(Q K_s^T) V_s`` with their log-sum-exp ``l_s``; they merge exactly as

    ``l = log(sum_s exp(l_s))``,   ``O = sum_s exp(l_s - l) O_s``

(Liu et al., Ring Attention, 2023).  Causal attention masks each key after a row by the positions and skips a block
whose keys all come after my rows; over contiguous chunks member ``p - 1`` works the most
(``ir.attention.causal_skew``), over zig-zag ones every member about the same.  A row none of whose keys in a block
comes before it gets nothing from that block; my own block comes first, so every row's sum starts non-empty.

Backward passes the blocks around again (each pass, too, during the block's compute), their keys' and values'
gradients following each block once computed (a second message, blocking): with the final ``O``
and ``l``, block ``s``'s probabilities are ``P_s = exp(Q K_s^T * c - l)`` and

    ``dV_s = P_s^T dO``,  ``dS = P_s * (dO V_s^T - rowsum(dO * O))``,  ``dQ += c dS K_s``,  ``dK_s = c dS^T Q``

(FlashAttention's backward, blockwise), each member adding its rows' share to the block's ``dK_s, dV_s`` as it
passes; after ``p - 1`` passes the sums are complete one member before their owner, and one more pass of the
gradients alone brings them home.  Grouped-query heads are expanded per block and their gradients summed back.
Everything is public tensor arithmetic: exact in any dtype on any device (half precision accumulates in float32).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Function

from ..ir.accumulation import widened
from ..tiling import chunk_range
from .comm import Group

__all__ = ["ring_attention"]


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, causal: bool,
                   scale: float | None, rows: list[torch.Tensor], keys: list[torch.Tensor]) -> torch.Tensor:
    """My query rows' attention over every member's keys and values (module docstring); ``rows[m]`` and
    ``keys[m]``: the global positions of member ``m``'s query rows and keys, in its tiles' order."""
    c = scale if scale is not None else query.shape[-1] ** -0.5
    return _Ring.apply(query, key, value, group, causal, c, rows, keys)


def contiguous(n: int, p: int, device: torch.device) -> list[torch.Tensor]:
    """Every member's positions when a length-``n`` sequence is split in ``p`` contiguous chunks."""
    return [torch.arange(*chunk_range(n, p, m), device=device) for m in range(p)]


def _spread(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values ``(..., h_kv, S, E)`` repeated to ``heads`` heads."""
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _gather_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``_spread``'s adjoint: the repeated heads' gradients summed back onto ``kv_heads``."""
    if g.shape[-3] == kv_heads:
        return g
    return g.unflatten(-3, (kv_heads, g.shape[-3] // kv_heads)).sum(-3)


def _scores(q: torch.Tensor, k: torch.Tensor, c: float, causal: bool, rows: torch.Tensor, keys: torch.Tensor
            ) -> torch.Tensor:
    """``Q K^T * c`` of my rows at positions ``rows`` and a block of keys at ``keys``; causal: a key after its row
    masked (``-inf``)."""
    s = (q @ k.transpose(-1, -2)) * c
    if causal and int(keys.max()) > int(rows.min()):
        s = s.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
    return s


def _skipped(causal: bool, rows: torch.Tensor, keys: torch.Tensor) -> bool:
    """Causal, and every key of the block comes after every row of mine: nothing to compute."""
    return causal and (not len(keys) or not len(rows) or int(keys.min()) > int(rows.max()))


def _start_pass(blocks: list[torch.Tensor], group: Group, incoming: int) -> Callable[[], list[torch.Tensor]]:
    """Start sending ``blocks`` (each ``(..., n, E_i)``, one sequence length ``n``, one dtype) to the next member and
    receiving the previous member's, ``incoming`` rows long: one message, the blocks packed row by row.  Returns
    the wait for them: a group that can start an exchange (``TorchGroup.exchange_start``) moves them while the
    caller computes; the thread tier's groups exchange at once."""
    p, me = group.size, group.index
    rows = [b.movedim(-2, 0).reshape(b.shape[-2], -1) for b in blocks]
    widths = [r.shape[1] for r in rows]
    packed = torch.cat(rows, 1)
    sends = {(me + 1) % p: packed}
    shapes: dict[int, tuple[int, ...]] = {(me - 1) % p: (incoming, packed.shape[1])}
    start = getattr(group, "exchange_start", None)
    if start is not None:
        pending = start(sends, shapes, packed)
        received: Callable[[], dict[int, torch.Tensor]] = pending.wait
    else:
        got = group.exchange(sends, shapes, packed)
        received = lambda: got  # noqa: E731

    def wait() -> list[torch.Tensor]:
        whole = received()[(me - 1) % p]
        out = []
        for b, part in zip(blocks, whole.split(widths, 1)):
            shape = b.movedim(-2, 0).shape[1:]
            out.append(part.reshape(incoming, *shape).movedim(0, -2))
        return out

    return wait


def _pass(blocks: list[torch.Tensor], group: Group, incoming: int) -> list[torch.Tensor]:
    """``_start_pass``, waited for at once."""
    return _start_pass(blocks, group, incoming)()


class _Ring(Function):
    """Ring attention's forward and backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, causal: bool, c: float,
                rows: list[torch.Tensor], keys: list[torch.Tensor]) -> torch.Tensor:
        p, me = group.size, group.index
        acc = widened(q.dtype)
        qa = q.to(acc)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kb, vb = k, v
        for j in range(p):
            src, nxt = (me - j) % p, (me - j - 1) % p
            # the next block moves while this one computes
            arriving = _start_pass([kb, vb], group, len(keys[nxt])) if j < p - 1 else None
            if not _skipped(causal, rows[me], keys[src]):
                s = _scores(qa, _spread(kb, q.shape[-3]).to(acc), c, causal, rows[me], keys[src])
                ls = torch.logsumexp(s, -1)
                finite = ls.masked_fill(torch.isinf(ls), 0.0)  # a row with no key here: its terms are all 0
                os = torch.exp(s - finite[..., None]) @ _spread(vb, q.shape[-3]).to(acc)
                new = torch.logaddexp(lse, ls)
                out = out * torch.exp(lse - new)[..., None] + os * torch.exp(ls - new)[..., None]
                lse = new
            if arriving is not None:
                kb, vb = arriving()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.c, ctx.rows, ctx.keys = group, causal, c, rows, keys
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, c, rows, keys = ctx.group, ctx.causal, ctx.c, ctx.rows, ctx.keys
        p, me, heads = group.size, group.index, q.shape[-3]
        acc = out.dtype
        qa, do = q.to(acc), dout.to(acc)
        delta = (do * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(qa)
        kb, vb = k, v
        dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
        for j in range(p):
            src, nxt = (me - j) % p, (me - j - 1) % p
            arriving = _start_pass([kb, vb], group, len(keys[nxt])) if j < p - 1 else None
            if not _skipped(causal, rows[me], keys[src]):
                ke, ve = _spread(kb, heads).to(acc), _spread(vb, heads).to(acc)
                prob = torch.exp(_scores(qa, ke, c, causal, rows[me], keys[src]) - lse[..., None])
                dv = dv + _gather_heads(prob.transpose(-1, -2) @ do, kb.shape[-3])
                ds = prob * (do @ ve.transpose(-1, -2) - delta)
                dq = dq + (ds @ ke) * c
                dk = dk + _gather_heads((ds.transpose(-1, -2) @ qa) * c, kb.shape[-3])
            if arriving is not None:  # the block's gradients so far follow it, once computed
                kb, vb = arriving()
                dk, dv = _pass([dk, dv], group, len(keys[nxt]))
            elif p > 1:  # the block's gradients are whole: home to its owner, the next member
                dk, dv = _pass([dk, dv], group, len(keys[me]))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
