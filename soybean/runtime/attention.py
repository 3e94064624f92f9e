"""Causal attention on a tile of the query rows (``rules.attention``'s row split of an ``is_causal`` op).

My rows are rows ``[a, b)`` of the whole query sequence (``tiling.nested_range`` over the ``row_axes``); keys
and values are whole.  Row ``a + i`` attends to keys ``0 .. a + i``: the causal mask offset by ``a``, given as an
explicit boolean mask (``tril(diagonal=a)``), so each row's softmax is the serial row's.  Backward is autograd's
through ``scaled_dot_product_attention``.

``zigzag`` (one row axis of ``p`` members): my rows go to the members that compute them in the zig-zag layout
(``ir.attention.zigzag_moves``), I compute chunks ``r`` and ``2p - 1 - r`` with the mask of their global positions,
and the results come back to the contiguous tiles; both moves are ``collectives.move_rows``, whose backward is the
inverse move.

``ring`` (one axis): keys and values split along the sequence too, passed around the members
(``runtime.ring.ring_attention``); with ``zigzag`` too, the queries, keys and values move to the zig-zag layout
first and the ring runs there (torchtitan's load-balanced ring).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..ir.attention import zigzag_moves
from ..tiling import nested_range
from .collectives import move_rows
from .comm import Group
from .context import current_groups
from .ring import contiguous, ring_attention

__all__ = ["sb_sdpa_rows"]


def sb_sdpa_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, *, row_axes: Sequence[int] = (), rows: int = 0,
                 zigzag: bool = False, ring: bool = False, keys: int = 0) -> torch.Tensor:
    """``scaled_dot_product_attention`` of my query rows (module docstring): ``rows`` in the whole sequence
    (``keys``: the whole key sequence, for ``ring``)."""
    groups = current_groups()
    if ring and zigzag and is_causal:
        (axis,) = row_axes
        return _ring_zigzag(query, key, value, scale, groups[axis], rows)
    if ring:
        (axis,) = row_axes
        g = groups[axis]
        return ring_attention(query, key, value, g, is_causal, scale, contiguous(rows, g.size, query.device),
                              contiguous(keys, g.size, query.device))
    if zigzag and is_causal:
        (axis,) = row_axes
        return _zigzag(query, key, value, dropout_p, scale, enable_gqa, groups[axis], rows)
    lo, _ = nested_range(rows, [(groups[a].size, groups[a].index) for a in row_axes])
    if not is_causal:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, False, scale=scale,
                                              enable_gqa=enable_gqa)
    mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril(lo)
    return F.scaled_dot_product_attention(query, key, value, mask, dropout_p, False, scale=scale,
                                          enable_gqa=enable_gqa)


class _ZigZag:
    """Member ``me``'s moves between its contiguous tile of a ``rows``-long sequence and its zig-zag rows
    (``ir.attention.zigzag_moves``): ``there`` sends a tensor's rows (dim ``-2``) to the members that compute them
    and returns mine, ascending; ``back`` returns results to their contiguous tiles.  Both are
    ``collectives.move_rows`` (backward: the inverse move)."""

    def __init__(self, group: Group, rows: int, device: torch.device) -> None:
        p, me = group.size, group.index
        moves = zigzag_moves(rows, p)
        mine = moves[me]                                      # my rows, by the member that computes them
        lo = min((a for d in mine for a, _ in d), default=0)  # my contiguous tile's first row
        self.group = group
        self.order = torch.tensor([i - lo for d in mine for a, b in d for i in range(a, b)], dtype=torch.long,
                                  device=device)
        self.send = tuple(sum(b - a for a, b in d) for d in mine)
        self.recv = tuple(sum(b - a for a, b in moves[s][me]) for s in range(p))
        self.positions = [torch.tensor([i for s in range(p) for a, b in moves[s][m] for i in range(a, b)],
                                       dtype=torch.long, device=device) for m in range(p)]  # each member's rows
        self.mine = self.positions[me]

    def there(self, t: torch.Tensor) -> torch.Tensor:
        rows_first = t.movedim(-2, 0)  # (rows, ...): move_rows moves dim 0
        return move_rows(rows_first.index_select(0, self.order), self.group, self.send, self.recv).movedim(0, -2)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        moved = move_rows(t.movedim(-2, 0).contiguous(), self.group, self.recv, self.send)  # as sent
        return moved.index_select(0, torch.argsort(self.order)).movedim(0, -2)


def _zigzag(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, scale: float | None,
            enable_gqa: bool, group: Group, rows: int) -> torch.Tensor:
    """Causal attention of my contiguous query rows, computed in the zig-zag layout (module docstring)."""
    zz = _ZigZag(group, rows, query.device)
    mask = zz.mine[:, None] >= torch.arange(key.shape[-2], device=query.device)[None, :]
    out = F.scaled_dot_product_attention(zz.there(query), key, value, mask, dropout_p, False, scale=scale,
                                         enable_gqa=enable_gqa)
    return zz.back(out)


def _ring_zigzag(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, group: Group,
                 rows: int) -> torch.Tensor:
    """Causal ring attention computed in the zig-zag layout: my query, key and value rows moved to their zig-zag
    members, the ring run there with every block's positions, the results moved back."""
    zz = _ZigZag(group, rows, query.device)
    out = ring_attention(zz.there(query), zz.there(key), zz.there(value), group, True, scale, zz.positions,
                         zz.positions)
    return zz.back(out)
