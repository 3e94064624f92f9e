"""Collective algorithms on point-to-point messages: ``lp``, ``ring`` and ``tree`` beside the backend's own.

What each costs (rounds and bytes of the busiest member, the lp chunk count) is planning's and lives in
``soybean.ir.algorithms`` with the table of formulas; this module runs them.

Every algorithm runs as synchronous rounds: every member calls ``group.exchange`` once a round (the
thread tier's exchange is a swap all members join; a process group's is a batched ``isend``/``irecv``
among the named peers only, a round with nothing to move costs nothing).  Tiles may be uneven or empty
(``tiling.chunk_range``): sizes are derived from the full length, so nothing is padded and an empty
block is never sent.  Sums are formed once per element and copied, so replicas stay bitwise equal.
Adjoints: broadcast and reduce are each other's; all-gather and reduce-scatter are each other's;
all-reduce's is the identity on the summands (``collectives``).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

# Re-exported: the runtime's callers (calibration, benchmarks) time an algorithm and price it by one name.
from ..ir.algorithms import (
    ADJOINT,
    ALGORITHMS,
    BACKEND,
    BACKEND_ALGO,
    COLLECTIVES,
    MAX_CHUNKS,
    P2P,
    Algo,
    check,
    lp_chunks,
    terms,
)
from ..tiling import chunk_range
from .comm import Group, chunk_len, take_chunk

__all__ = ["ADJOINT", "ALGORITHMS", "BACKEND", "BACKEND_ALGO", "COLLECTIVES", "MAX_CHUNKS", "P2P", "Algo",
           "all_gather", "all_reduce", "broadcast", "check", "lp_chunks", "reduce", "reduce_scatter", "terms"]


# ---- one round of point-to-point messages --------------------------------------------------


def _round(group: Group, sends: dict[int, torch.Tensor], recvs: dict[int, int],
           like: torch.Tensor) -> dict[int, torch.Tensor]:
    """Send ``sends[j]`` to member ``j`` and receive ``recvs[j]`` elements from member ``j`` (flat); every
    member calls this once a round.  Empty messages are not sent: both sides know every size."""
    got = group.exchange({j: t.reshape(-1) for j, t in sends.items() if t.numel()},
                         {j: (n,) for j, n in recvs.items() if n}, like)
    return {j: got[j] if n else like.new_empty(0) for j, n in recvs.items()}


def _segments(n: int, k: int) -> list[slice]:
    """``k`` contiguous, near-equal pieces of ``range(n)`` (``tiling.chunk_range``)."""
    return [slice(*chunk_range(n, k, c)) for c in range(k)]


def _size(s: slice) -> int:
    return s.stop - s.start


def _masks(p: int) -> list[int]:
    """The binomial tree's round masks 1, 2, 4, ... below ``p``."""
    return [1 << i for i in range((p - 1).bit_length())]


def _ring_reduce_scatter(g: Group, buf: torch.Tensor, seg: list[slice], pos: int, right: int, left: int) -> None:
    """``p - 1`` rounds round the ring (``pos``: my place on it): I pass on the partial of segment ``pos - t`` and
    add the one of ``pos - t - 1`` I receive, so segment ``pos + 1`` ends summed."""
    p = len(seg)
    for t in range(p - 1):
        s, r = seg[(pos - t) % p], seg[(pos - t - 1) % p]
        buf[r] = _round(g, {right: buf[s]}, {left: _size(r)}, buf)[left] + buf[r]


def _ring_all_gather(g: Group, buf: torch.Tensor, seg: list[slice], own: int, right: int, left: int,
                     keep: bool = False) -> None:
    """``p - 1`` rounds round the ring, starting from my segment ``own``: I pass on segment ``own - t`` and
    store ``own - t - 1`` (``keep``: I hold every segment already and store nothing)."""
    p = len(seg)
    for t in range(p - 1):
        s, r = seg[(own - t) % p], seg[(own - t - 1) % p]
        piece = _round(g, {right: buf[s]}, {left: _size(r)}, buf)[left]
        if not keep:
            buf[r] = piece


def _chain(g: Group, buf: torch.Tensor, k: int, rel: int, peer: Callable[[int], int], add: bool) -> None:
    """``k`` chunks down the chain of relative ranks ``0 -> p - 1`` (``peer``: a relative rank's member), one
    hop a round, ``p - 2 + k`` rounds: relative rank ``r`` passes chunk ``c`` on in round ``c + r``, having stored
    it (broadcast) or added its own to it (``add``: reduce) the round before."""
    p = g.size
    seg = _segments(buf.numel(), k)
    for t in range(p - 2 + k):
        c_out, c_in = t - rel, t - (rel - 1)
        sends = {peer(rel + 1): buf[seg[c_out]]} if rel < p - 1 and 0 <= c_out < k else {}
        recvs = {peer(rel - 1): _size(seg[c_in])} if rel > 0 and 0 <= c_in < k else {}
        got = _round(g, sends, recvs, buf)
        if recvs:
            s = seg[c_in]
            buf[s] = got[peer(rel - 1)] + buf[s] if add else got[peer(rel - 1)]


# ---- all-reduce ------------------------------------------------------------------------------


def _all_reduce_ring(g: Group, buf: torch.Tensor, k: int) -> None:
    """Reduce-scatter round the ring, then all-gather: member ``i`` ends the first phase owning segment
    ``i + 1``."""
    p, me = g.size, g.index
    seg = _segments(buf.numel(), p)
    right, left = (me + 1) % p, (me - 1) % p
    _ring_reduce_scatter(g, buf, seg, me, right, left)
    _ring_all_gather(g, buf, seg, me + 1, right, left)


def _all_reduce_tree(g: Group, buf: torch.Tensor, k: int) -> None:
    """Recursive doubling; with ``p`` not a power of two the first ``2 rem`` members fold pairwise onto the
    odd one of each pair first and get the sum back at the end (``rem = p - 2^floor(log2 p)``)."""
    p, me, n = g.size, g.index, buf.numel()
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    if rem:
        if me < 2 * rem and me % 2 == 0:
            _round(g, {me + 1: buf}, {}, buf)
        elif me < 2 * rem:
            buf += _round(g, {}, {me - 1: n}, buf)[me - 1]
        else:
            _round(g, {}, {}, buf)
    new = -1 if me < 2 * rem and me % 2 == 0 else (me // 2 if me < 2 * rem else me - rem)
    mask = 1
    while mask < pof2:
        if new < 0:
            _round(g, {}, {}, buf)
        else:
            pn = new ^ mask
            peer = pn * 2 + 1 if pn < rem else pn + rem
            got = _round(g, {peer: buf}, {peer: n}, buf)[peer]
            buf += got  # a + b on one side, b + a on the other: addition commutes, the replicas agree bitwise
        mask <<= 1
    if rem:
        if me < 2 * rem and me % 2 == 0:
            buf.copy_(_round(g, {}, {me + 1: n}, buf)[me + 1])
        elif me < 2 * rem:
            _round(g, {me - 1: buf}, {}, buf)
        else:
            _round(g, {}, {}, buf)


def _all_reduce_lp(g: Group, buf: torch.Tensor, k: int) -> None:
    """Down the chain ``0 -> p - 1`` in ``k`` chunks (member ``i`` adds its chunk ``c`` to the partial and
    passes it on in round ``c + i``), and, overlapped, the finished chunks back up from ``p - 1`` (member
    ``j`` passes chunk ``c`` on in round ``c + 2 p - 2 - j``): ``2 p - 3 + k`` rounds."""
    p, me = g.size, g.index
    seg = _segments(buf.numel(), k)
    for t in range(2 * p - 3 + k if p > 2 else k + 1):
        sends: dict[int, torch.Tensor] = {}
        recvs: dict[int, int] = {}
        c_red, c_bc_out = t - me, t - (2 * p - 2 - me)
        if me < p - 1 and 0 <= c_red < k:
            sends[me + 1] = buf[seg[c_red]]
        if me > 0 and 0 <= c_bc_out < k:
            sends[me - 1] = buf[seg[c_bc_out]]
        c_red_in, c_bc_in = t - (me - 1), t - (2 * p - 3 - me)
        if me > 0 and 0 <= c_red_in < k:
            recvs[me - 1] = _size(seg[c_red_in])
        if me < p - 1 and 0 <= c_bc_in < k:
            recvs[me + 1] = _size(seg[c_bc_in])
        got = _round(g, sends, recvs, buf)
        if me - 1 in got and me > 0:
            s = seg[c_red_in]
            buf[s] = got[me - 1] + buf[s]
        if me + 1 in got and me < p - 1:
            buf[seg[c_bc_in]] = got[me + 1]


_ALL_REDUCE: dict[str, Callable[[Group, torch.Tensor, int], None]] = {
    "ring": _all_reduce_ring, "tree": _all_reduce_tree, "lp": _all_reduce_lp}


def all_reduce(group: Group, x: torch.Tensor, algo: Algo) -> torch.Tensor:
    """``sum_j x_j`` on every member, a new tensor."""
    name, k = algo
    if group.size == 1:
        return x.detach().clone()
    if name == BACKEND:
        return group.all_reduce(x)
    buf = x.detach().contiguous().reshape(-1).clone()
    _ALL_REDUCE[check(name)](group, buf, max(1, k))
    return buf.view(x.shape)


# ---- broadcast and reduce ----------------------------------------------------------------------


def _broadcast_flat(g: Group, buf: torch.Tensor, root: int, name: str, k: int) -> None:
    p, me = g.size, g.index
    rel = (me - root) % p
    peer = lambda r: (r + root) % p  # noqa: E731  (a relative rank's member)
    n = buf.numel()
    if name == "lp":
        _chain(g, buf, k, rel, peer, add=False)
    elif name == "tree":
        for mask in _masks(p):
            if rel < mask and rel + mask < p:
                _round(g, {peer(rel + mask): buf}, {}, buf)
            elif mask <= rel < 2 * mask:
                buf.copy_(_round(g, {}, {peer(rel - mask): n}, buf)[peer(rel - mask)])
            else:
                _round(g, {}, {}, buf)
    else:  # ring: the root scatters one segment to each member, then a ring all-gather of the segments
        seg = _segments(n, p)
        if rel == 0:
            _round(g, {peer(r): buf[seg[r]] for r in range(1, p)}, {}, buf)
        else:
            buf[seg[rel]] = _round(g, {}, {root: _size(seg[rel])}, buf)[root]
        _ring_all_gather(g, buf, seg, rel, peer(rel + 1), peer(rel - 1), keep=rel == 0)


def broadcast(group: Group, x: torch.Tensor, root: int, algo: Algo) -> torch.Tensor:
    """Member ``root``'s ``x`` on every member, a new tensor (the others' ``x`` gives only shape and dtype)."""
    name, k = algo
    if group.size == 1:
        return x.detach().clone()
    if name == BACKEND:
        return group.broadcast(x, root)
    buf = x.detach().contiguous().reshape(-1).clone()
    _broadcast_flat(group, buf, root, check(name), max(1, k))
    return buf.view(x.shape)


def _reduce_flat(g: Group, buf: torch.Tensor, root: int, name: str, k: int) -> None:
    p, me = g.size, g.index
    n = buf.numel()
    if name == "lp":  # the chain ends at the root: relative rank p - 1
        _chain(g, buf, k, (me - root - 1) % p, lambda r: (r + root + 1) % p, add=True)
        return
    rel = (me - root) % p
    peer = lambda r: (r + root) % p  # noqa: E731
    if name == "tree":  # binomial, the broadcast's rounds in reverse
        for mask in reversed(_masks(p)):
            if rel < mask and rel + mask < p:
                buf += _round(g, {}, {peer(rel + mask): n}, buf)[peer(rel + mask)]
            elif mask <= rel < 2 * mask:
                _round(g, {peer(rel - mask): buf}, {}, buf)
            else:
                _round(g, {}, {}, buf)
        return
    # ring: reduce-scatter round the ring (relative rank r ends owning segment r + 1), then gather at the root
    seg = _segments(n, p)
    _ring_reduce_scatter(g, buf, seg, rel, peer(rel + 1), peer(rel - 1))
    own = seg[(rel + 1) % p]
    if rel == 0:
        pieces = _round(g, {}, {peer(q): _size(seg[(q + 1) % p]) for q in range(1, p)}, buf)
        for q in range(1, p):
            buf[seg[(q + 1) % p]] = pieces[peer(q)]
    else:
        _round(g, {root: buf[own]}, {}, buf)


def reduce(group: Group, x: torch.Tensor, root: int, algo: Algo) -> torch.Tensor:
    """``sum_j x_j`` on member ``root`` and zeros on the others, a new tensor."""
    name, k = algo
    if group.size == 1:
        return x.detach().clone()
    if name == BACKEND:
        return group.reduce(x, root)
    buf = x.detach().contiguous().reshape(-1).clone()
    _reduce_flat(group, buf, root, check(name), max(1, k))
    return buf.view(x.shape) if group.index == root else torch.zeros_like(x)


# ---- all-gather and reduce-scatter ------------------------------------------------------------


def _tile_shape(shape: tuple[int, ...] | torch.Size, dim: int, full: int, p: int, j: int) -> list[int]:
    return [chunk_len(full, p, j) if d == dim else s for d, s in enumerate(shape)]


def all_gather(group: Group, x: torch.Tensor, dim: int, full: int, algo: Algo) -> torch.Tensor:
    """``cat_j x_j`` along ``dim`` (``x_j`` is chunk ``j`` of a length-``full`` dim) on every member."""
    name, _ = algo
    p, me = group.size, group.index
    dim = dim % x.ndim
    if p == 1:
        return x.detach().clone()
    if name == BACKEND:
        return group.all_gather(x, dim, full)
    shapes = [_tile_shape(x.shape, dim, full, p, j) for j in range(p)]
    sizes = [math.prod(s) for s in shapes]
    blocks: list[torch.Tensor | None] = [None] * p
    blocks[me] = x.detach().contiguous().reshape(-1)
    xd = blocks[me]
    assert xd is not None
    if name == "ring":
        right, left = (me + 1) % p, (me - 1) % p
        for t in range(p - 1):
            s, r = (me - t) % p, (me - 1 - t) % p
            blocks[r] = _round(group, {right: blocks[s]}, {left: sizes[r]}, xd)[left]  # type: ignore[dict-item]
    elif name == "lp":  # block j travels the chain both ways from member j, one hop a round
        for t in range(p - 1):
            sends: dict[int, torch.Tensor] = {}
            recvs: dict[int, int] = {}
            if me < p - 1 and me - t >= 0:
                sends[me + 1] = blocks[me - t]  # type: ignore[assignment]
            if me > 0 and me + t <= p - 1:
                sends[me - 1] = blocks[me + t]  # type: ignore[assignment]
            if me > 0 and me - 1 - t >= 0:
                recvs[me - 1] = sizes[me - 1 - t]
            if me < p - 1 and me + 1 + t <= p - 1:
                recvs[me + 1] = sizes[me + 1 + t]
            got = _round(group, sends, recvs, xd)
            if me - 1 in recvs:
                blocks[me - 1 - t] = got[me - 1]
            if me + 1 in recvs:
                blocks[me + 1 + t] = got[me + 1]
    else:  # tree: binomial gather of contiguous block ranges at member 0, then binomial broadcast of them all
        flat = xd
        for mask in _masks(p):
            if me % (2 * mask) == mask:
                _round(group, {me - mask: flat}, {}, xd)
            elif me % (2 * mask) == 0 and me + mask < p:
                n = sum(sizes[me + mask:min(me + 2 * mask, p)])
                flat = torch.cat([flat, _round(group, {}, {me + mask: n}, xd)[me + mask]])
            else:
                _round(group, {}, {}, xd)
        whole = flat if me == 0 else xd.new_empty(sum(sizes))
        _broadcast_flat(group, whole, 0, "tree", 1)
        blocks = list(whole.split(sizes))
    return torch.cat([b.view(s) for b, s in zip(blocks, shapes)], dim)  # type: ignore[union-attr]


def reduce_scatter(group: Group, x: torch.Tensor, dim: int, algo: Algo) -> torch.Tensor:
    """Chunk ``index`` along ``dim`` of ``sum_j x_j``."""
    name, _ = algo
    p, me = group.size, group.index
    dim = dim % x.ndim
    if p == 1:
        return x.detach().clone()
    if name == BACKEND:
        return group.reduce_scatter(x, dim)
    xd = x.detach()
    parts = [take_chunk(xd, dim, p, j) for j in range(p)]
    shapes = [list(c.shape) for c in parts]
    sizes = [c.numel() for c in parts]
    acc = [c.contiguous().reshape(-1) for c in parts]
    if name == "ring":  # member i passes on the partial of block i - 1 - t; block i completes at the last round
        right, left = (me + 1) % p, (me - 1) % p
        for t in range(p - 1):
            s, r = (me - 1 - t) % p, (me - 2 - t) % p
            acc[r] = _round(group, {right: acc[s]}, {left: sizes[r]}, xd)[left] + acc[r]
        out = acc[me]
    elif name == "lp":  # the all-gather's rounds in reverse: block j's partials run down the chain to j both ways
        right_part = left_part = None
        for t in range(p - 1):
            sends: dict[int, torch.Tensor] = {}
            recvs: dict[int, int] = {}
            j_out_r, j_out_l = p - 1 + me - t, t - (p - 1 - me)   # blocks I pass right / left
            j_in_r, j_in_l = p - 2 + me - t, t - p + 2 + me        # blocks I receive from the left / right
            if me < p - 1 and t >= me and j_out_r <= p - 1:
                sends[me + 1] = acc[j_out_r]
            if me > 0 and t >= p - 1 - me and j_out_l >= 0:
                sends[me - 1] = acc[j_out_l]
            if me > 0 and t >= me - 1 and j_in_r <= p - 1:
                recvs[me - 1] = sizes[j_in_r]
            if me < p - 1 and t >= p - 2 - me and j_in_l >= 0:
                recvs[me + 1] = sizes[j_in_l]
            got = _round(group, sends, recvs, xd)
            if me - 1 in recvs:
                if j_in_r == me:
                    right_part = got[me - 1]
                else:
                    acc[j_in_r] = got[me - 1] + acc[j_in_r]
            if me + 1 in recvs:
                if j_in_l == me:
                    left_part = got[me + 1]
                else:
                    acc[j_in_l] = got[me + 1] + acc[j_in_l]
        out = acc[me]
        out = out if right_part is None else right_part + out
        out = out if left_part is None else out + left_part
    else:  # tree: binomial reduce of every block at member 0, then binomial scatter of block ranges
        whole = torch.cat(acc)
        _reduce_flat(group, whole, 0, "tree", 1)
        offs = [0, *np.cumsum(sizes).tolist()]
        flat = whole if me == 0 else xd.new_empty(0)
        lo = me  # I hold blocks [lo, hi) of ``flat`` (member 0 starts with all of them)
        for mask in reversed(_masks(p)):
            if me % (2 * mask) == 0 and me + mask < p:
                a, b = offs[me + mask] - offs[lo], offs[min(me + 2 * mask, p)] - offs[lo]
                _round(group, {me + mask: flat[a:b]}, {}, xd)
                flat = flat[:a]
            elif me % (2 * mask) == mask:
                n = offs[min(me + mask, p)] - offs[me]
                flat = _round(group, {}, {me - mask: n}, xd)[me - mask]
            else:
                _round(group, {}, {}, xd)
        out = flat[:sizes[me]]
    return out.reshape(shapes[me]).clone() if out.numel() else xd.new_zeros(shapes[me])

