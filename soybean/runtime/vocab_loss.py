"""Cross-entropy on my classes of the logits (``rules.loss``' class split; the maths in ``ir.loss_parallel``).

``_ClassSplitNLL`` gives each row's ``lse_i - x_{i, y_i}`` over every class: my two statistics per row, all-gathered
over each class axis and combined (log-sum-exp of the members' ``lse``, sum of their picked logits).  Backward is
local: ``g_i (exp(x_ic - lse_i) - [c = y_i])`` on my classes.  The class weights, ``ignore_index`` and the reduction
then apply to those whole rows as ``torch.nn.functional.cross_entropy`` applies them, so every member of the class
group holds the same loss (a replicated output).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

from ..ir.accumulation import widened
from ..ir.losses import mean_count
from ..tiling import nested_range
from .comm import Group
from .context import current_groups

__all__ = ["sb_cross_entropy"]


class _ClassSplitNLL(Function):
    """``lse_i - x_{i, y_i}`` per row (over the whole class dim) from my classes ``[lo, lo + x.shape[1])``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, lo: int, groups: Sequence[Group]) -> torch.Tensor:
        acc, n = widened(x.dtype), x.shape[1]
        xa = x.to(acc)
        local = target - lo
        mine = (local >= 0) & (local < n)
        at = local.clamp(0, max(n - 1, 0)).unsqueeze(1)
        picked = torch.where(mine, xa.gather(1, at).squeeze(1), torch.zeros((), dtype=acc, device=x.device))
        stats = torch.stack([torch.logsumexp(xa, 1), picked])
        for g in groups:  # every member's statistics, then combined: one all-gather per class axis
            if g.size > 1:
                every = g.all_gather(stats, 0, 2 * g.size).unflatten(0, (g.size, 2))
                stats = torch.stack([torch.logsumexp(every[:, 0], 0), every[:, 1].sum(0)])
        lse = stats[0]
        ctx.save_for_backward(x, at, mine, lse)
        return (lse - stats[1]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, at, mine, lse = ctx.saved_tensors
        ga = g.to(lse.dtype)
        gx = torch.exp(x.to(lse.dtype) - lse.unsqueeze(1)) * ga.unsqueeze(1)
        gx.scatter_add_(1, at, -torch.where(mine, ga, torch.zeros((), dtype=ga.dtype, device=ga.device)).unsqueeze(1))
        return gx.to(x.dtype), None, None, None


def sb_cross_entropy(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, reduction: int = 1,
                     ignore_index: int = -100, label_smoothing: float = 0.0, *, class_axes: Sequence[int] = (),
                     classes: int = 0) -> torch.Tensor:
    """``aten.cross_entropy_loss`` (class-index targets, no label smoothing) on my tile of the logits, split along
    the class dim (dim 1) over mesh ``class_axes``; ``classes``: the whole class dim."""
    assert label_smoothing == 0.0 and target.dim() == self.dim() - 1, "the class split takes class indices only"
    groups = current_groups()
    split = [groups[a] for a in class_axes]
    lo, hi = nested_range(classes, [(g.size, g.index) for g in split])
    assert hi - lo == self.shape[1], f"my classes [{lo}, {hi}) but a tile of {self.shape[1]}"
    nll = _ClassSplitNLL.apply(self, target, lo, split)
    valid = target != ignore_index
    # torch gives the class weights no gradient (nll_loss has no derivative for them): read them detached
    fixed = None if weight is None else weight.detach()
    w = valid.to(nll.dtype) if fixed is None else torch.where(valid, fixed[target.clamp(0)], 0.0)
    rows = nll * w
    if reduction == 0:
        return rows
    total = rows.sum()
    return total if reduction == 2 else total / mean_count("classes", self.numel(), target,
                                                          {"ignore_index": ignore_index, "weight": fixed})
