"""Routed experts split over mesh axes (expert parallelism): what a program runs for ``soybean::routed_experts``
when its plan splits the experts (``rules.experts``).

Expert ``e`` lives on the rank whose tile of the experts' dim 0 holds it (``tiling.chunk_range``, axis by axis
in mesh order).  Each (token, choice) row of my tokens ``x[t]`` for expert ``idx[t, j]``:

* on an axis where my tokens are whole (``shard`` but not ``a2a``), only the member holding the expert computes
  it; the others drop the row, and the output (and the tokens' gradient) is a pending sum there;
* on each ``a2a`` axis, the rows are sorted by the member holding their expert and moved there
  (``collectives.move_rows``, sizes exchanged first); after the last move every row is for one of my experts.

My experts run on my rows (``ir.experts.expert_rows``, ids local to my tile), the results go back by the inverse
moves, and ``ir.experts.combine`` weights and sums them per token: the serial op's values, each row computed by
the same body once.  Backward is autograd's through the same steps; each move's backward is its adjoint.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ir.experts import combine, expert_rows
from ..tiling import nested_range
from .collectives import move_rows
from .comm import Group
from .context import current_groups

__all__ = ["sb_routed_experts"]


def _owner(ids: torch.Tensor, experts: int, shard: Sequence[int], groups: Sequence[Group]) -> dict[int, torch.Tensor]:
    """Per axis of ``shard``: the coordinate of the member holding each row's expert."""
    lo = torch.zeros_like(ids)
    hi = torch.full_like(ids, experts)
    out: dict[int, torch.Tensor] = {}
    for a in shard:
        p = groups[a].size
        c = torch.div(hi - lo + p - 1, p, rounding_mode="floor")  # the chunk length of the range holding e
        out[a] = torch.div(ids - lo, c, rounding_mode="floor")
        lo = lo + out[a] * c
        hi = torch.minimum(lo + c, hi)
    return out


def _mine(experts: int, shard: Sequence[int], groups: Sequence[Group]) -> tuple[int, int]:
    """My experts: ``[lo, hi)``."""
    return nested_range(experts, [(groups[a].size, groups[a].index) for a in shard])


def _counts(send: list[int], group: Group, like: torch.Tensor) -> list[int]:
    """How many rows each member sends me, for the ``send[j]`` I send each: one count to every member."""
    ones = (1,) * group.size
    got = group.all_to_all_rows(torch.tensor(send, dtype=torch.int64, device=like.device).view(-1, 1), ones, ones)
    return [int(n) for n in got.view(-1).tolist()]


def sb_routed_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, params: Sequence[torch.Tensor],
                      experts: int, body: str, *, shard: Sequence[int] = (), a2a: Sequence[int] = ()) -> torch.Tensor:
    """``ir.experts.routed_experts`` with the experts split over the mesh axes ``shard`` and the rows moved on
    those of ``a2a`` (module docstring); ``params`` are my tiles of the expert weights."""
    groups = current_groups()
    t, k = idx.shape
    ids = idx.reshape(-1)
    owner = _owner(ids, experts, shard, groups)
    keep = torch.ones_like(ids, dtype=torch.bool)
    for a in shard:
        if a not in a2a:
            keep &= owner[a] == groups[a].index
    sel = keep.nonzero().squeeze(1)
    rows, e = x[torch.div(sel, k, rounding_mode="floor")], ids[sel]
    undo: list[tuple[torch.Tensor, list[int], list[int], Group]] = []
    for a in a2a:
        g = groups[a]
        dest = _owner(e, experts, shard, groups)[a]
        order = torch.sort(dest, stable=True)[1]
        send = torch.bincount(dest, minlength=g.size).tolist()
        recv = _counts(send, g, e)
        rows = move_rows(rows[order], g, tuple(send), tuple(recv))
        e = move_rows(e[order], g, tuple(send), tuple(recv))
        undo.append((order, send, recv, g))
    lo, hi = _mine(experts, shard, groups)
    out = expert_rows(rows, e - lo, hi - lo, params, body)
    for order, send, recv, g in reversed(undo):
        back = move_rows(out, g, tuple(recv), tuple(send))
        out = back.new_zeros(back.shape).index_copy(0, order, back)
    full = out.new_zeros((ids.numel(), *out.shape[1:])).index_copy(0, sel, out)
    return combine(full, w)
