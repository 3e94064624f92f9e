"""The call a generated program makes for each collective kind of ``soybean.ir.kinds``.

The kinds table (placement change, forward and adjoint collectives, arguments) is planning's vocabulary and
lives in ``soybean.ir``; this registry is the runtime's half: kind name -> the ``sb_*`` function of
:mod:`.context` (which runs the autograd ``Function`` of :mod:`.collectives`).  Codegen joins the two:
``CALLS[step.kind](x, step.axis, *KINDS[step.kind].args(step, local_shape_after))``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import context as ctx

CALLS: dict[str, Callable[..., torch.Tensor]] = {
    "all_gather": ctx.sb_all_gather,
    "shard": ctx.sb_shard,
    "all_reduce": ctx.sb_all_reduce,
    "reduce_scatter": ctx.sb_reduce_scatter,
    "all_to_all": ctx.sb_all_to_all,
    "to_partial": ctx.sb_to_partial,
    "grad_all_reduce": ctx.sb_grad_all_reduce,
    "grad_to_partial": ctx.sb_grad_to_partial,
    "halo": ctx.sb_halo,
}

__all__ = ["CALLS"]
