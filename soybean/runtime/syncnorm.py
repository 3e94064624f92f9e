"""Batch norm in training mode on an input split along batch or spatial dims (synchronized statistics).

Per channel ``c``, over the ``n`` elements of every non-channel dim of the whole input::

    mean = (1 / n) sum x,   var = (1 / n) sum x^2 - mean^2,   r = 1 / sqrt(var + eps),
    y = (x - mean) r w + b,
    running_mean <- (1 - m) running_mean + m mean,   running_var <- (1 - m) running_var + m var n / (n - 1).

Each member holds a tile; the per-channel sums are its local sums all-reduced over the mesh axes that
split the input.  Backward, with ``g`` the output gradient and ``d = sum g (x - mean)``::

    dx = (g - (1 / n) sum g - (x - mean) r^2 d / n) r w,    dw = r d,    db = sum g,

where ``dx`` needs the whole sums (all-reduced again), while ``dw`` and ``db`` stay the member's own
sums: the weight and bias are replicated and read by split work, so their gradients are partial and
the gradient sync adds them (``ir.kinds``' ``grad_all_reduce``).  Each tile's statistics come
from ``torch.var_mean`` and are combined across tiles in float64 for float32 inputs (float32 for half
types) by one all-reduce of ``n_k mean_k`` and ``n_k (var_k + mean_k^2)``; float64 inputs, with no wider type,
all-reduce the mean first and then ``n_k (var_k + (mean_k - mean)^2)`` (Chan et al.), and backward sums
``g (x - mean)`` about the saved mean, as serial batch norm does, so results agree with it to rounding.  Only the
input, mean and ``r`` are kept for backward.  (Float64's second all-reduce is not priced: ``ir.syncnorm`` prices
one; float64 training is for checking.)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

from ..ir.syncnorm import acc_dtype as _acc
from .comm import Group
from .context import current_groups

__all__ = ["sb_batch_norm"]


def _sum(t: torch.Tensor, groups: Sequence[Group]) -> torch.Tensor:
    for g in groups:
        t = g.all_reduce(t) if g.size > 1 else t
    return t


class _SyncBatchNorm(Function):
    """``y = (x - mean) r w + b`` with the whole input's statistics (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                groups: Sequence[Group], count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc, dims = _acc(x.dtype), [0, *range(2, x.ndim)]
        # My tile's statistics by torch's own kernel, combined across tiles in the accumulation type (Chan et al.).
        n_k = x.numel() // max(x.shape[1], 1)
        if n_k:
            var_k, mean_k = torch.var_mean(x, dims, correction=0)
        else:  # an empty tile (uneven chunks) adds nothing: var_mean would give NaN
            var_k = mean_k = x.new_zeros(x.shape[1])
        mean_k, var_k = mean_k.to(acc), var_k.to(acc)
        # One all-reduce of n_k mean_k and n_k (var_k + mean_k^2) where a wider type keeps var = S2 / n - mean^2 to
        # the tile type's precision (float64 for float32 tiles: unless mean^2 / var passes about 1e8)
        if acc.itemsize > x.dtype.itemsize:
            sums = _sum(torch.stack([n_k * mean_k, n_k * (var_k + mean_k * mean_k)]), groups)
            mean = sums[0] / count
            var = (sums[1] / count - mean * mean).clamp_min(0)
        else:  # float64 tiles: no wider type, so the mean first, then each tile's squares about it (Chan et al.)
            mean = _sum(n_k * mean_k, groups) / count
            var = _sum(n_k * (var_k + (mean_k - mean) ** 2), groups) / count
        r = torch.rsqrt(var + eps)
        scale = r * weight.to(acc) if weight is not None else r
        shift = (bias.to(acc) if bias is not None else 0) - mean * scale
        view = [1, -1] + [1] * (x.ndim - 2)
        y = x * scale.to(x.dtype).view(view) + shift.to(x.dtype).view(view)
        ctx.save_for_backward(x, weight, mean, r)
        ctx.groups, ctx.count, ctx.has_bias = groups, count, bias is not None
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _m: Any, _v: Any) -> tuple:
        x, weight, mean, r = ctx.saved_tensors
        acc, dims, n = _acc(x.dtype), [0, *range(2, x.ndim)], ctx.count
        view = [1, -1] + [1] * (x.ndim - 2)
        sum_g = g.sum(dims).to(acc)
        # sum g (x - mean), my tile's, about the mean as serial batch norm sums it: (sum g x) - mean (sum g) is a
        # small difference of large sums where the mean is large against the spread (LeViT's 8-row norms).
        dot = (g * (x - mean.to(x.dtype).view(view))).sum(dims).to(acc)
        whole = _sum(torch.stack([sum_g, dot]), ctx.groups)
        w = weight.to(acc) if weight is not None else torch.ones_like(r)
        k1 = r * w                                                # dx = g k1 + x k2 + k3, per channel
        k2 = -r * r * r * w * whole[1] / n
        k3 = -k1 * whole[0] / n - k2 * mean
        gx = g * k1.to(g.dtype).view(view) + x * k2.to(g.dtype).view(view) + k3.to(g.dtype).view(view)
        gw = (dot * r).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        gb = sum_g.to(g.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None


def sb_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                  momentum: float, eps: float, cudnn_enabled: bool = True, *, axes: tuple[int, ...] = (),
                  count: int = 0) -> torch.Tensor:
    """``aten.batch_norm`` (training) on my tile, statistics summed over mesh ``axes``; ``count`` is the
    whole input's elements per channel."""
    groups = [current_groups()[a] for a in axes]
    y, mean, var = _SyncBatchNorm.apply(input, weight, bias, eps, groups, count)
    if training and running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y

