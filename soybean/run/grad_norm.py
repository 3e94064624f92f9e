"""The serial model's gradient norm from the tiles, and clipping by it: ``clip_grad_norm_`` on every module kind.

``torch.nn.utils.clip_grad_norm_(pmodel.parameters(), c)`` sees this rank's tiles: a sharded weight's slice, a
replicated one whole, a weight held by another pipeline stage or region not at all.  Its norm is not the model's and
differs between ranks, so clipping by it scales one replicated weight differently on each rank and the replicas
drift apart, with no error.  (FSDP's first version has the same limit and the same answer: the module's own
``clip_grad_norm_``.)  Every module ``parallelize`` returns has one, which computes what torch computes serially,

    ||g||_q  =  ( sum_p sum_i |g_p,i|^q )^(1/q)  =  ( sum_ranks sum_{p held} ||tile_p||_q^q / r_p )^(1/q),

``r_p`` the number of ranks that hold the same tile of ``p`` (the product of the mesh axes its stored tiling
replicates on), and a weight several parts read (a tie: a copy in each, each holding the summed gradient) counted in
the first part that reads it only; for ``q = inf`` the maximum over ranks of the largest ``|g|``.  Clipping then
multiplies every gradient tile by ``min(1, c / (||g|| + 1e-6))``, torch's formula, the same factor on every rank.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grads_with_norm_

from ..tiling import R


def share(named: Iterable[tuple[str, torch.Tensor]], mesh: Sequence[int], tiling: Callable[[str], Sequence],
          norm_type: float) -> torch.Tensor:
    """This rank's part of ``||g||_q^q`` (float64; for ``q = inf`` its largest ``|g|``) over the gradients
    ``named`` (name, gradient tile), each weighted by one over the ranks holding the same tile.  On the gradients'
    device (the CPU when there are none): no copy to the host per gradient, and NCCL reduces it where it lies."""
    total: torch.Tensor | None = None
    for name, g in named:
        g = g.detach().to(torch.float64)
        if math.isinf(norm_type):
            part = g.abs().max() if g.numel() else g.new_zeros(())
            total = part if total is None else torch.maximum(total, part)
            continue
        copies = math.prod(s for s, pl in zip(mesh, tiling(name)) if pl == R)
        part = g.abs().pow(norm_type).sum() / copies
        total = part if total is None else total + part
    return torch.zeros((), dtype=torch.float64) if total is None else total


def norm_of(total: torch.Tensor, norm_type: float, like: torch.dtype) -> torch.Tensor:
    """The norm from the world's sum (or maximum) of the shares, in the gradients' dtype as torch returns it."""
    return (total if math.isinf(norm_type) else total.pow(1.0 / norm_type)).to(like)


def world_total(mine: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The sum (``q = inf``: the maximum) of every rank's share, on every rank (the default process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    return mine


def check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (math.isinf(norm_type) and norm_type > 0) and not norm_type >= 1:
        raise ValueError(f"clip_grad_norm_: norm_type must be inf or at least 1, got {norm_type:g}")
    return norm_type


@torch.no_grad()
def clip(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor, error_if_nonfinite: bool) -> None:
    """The gradient of every tile in ``params`` times ``min(1, max_norm / (total + 1e-6))``: torch's own clipping by
    a given norm (``clip_grads_with_norm_``), after ``error_if_nonfinite``'s check (torch makes it where it forms the
    norm)."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of the gradients is {float(total)}: non-finite, so clipping cannot "
                           "proceed (error_if_nonfinite=True); skip this step or lower the learning rate")
    clip_grads_with_norm_(list(params), max_norm, total)
