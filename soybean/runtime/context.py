"""The current rank's groups, and the axis-based calls generated programs make.

A generated per-rank program is plain Python calling ``sb_*`` functions with a
tensor and int/bool arguments only: the mesh axis picks ``current_groups()[axis]``,
which :func:`use_groups` sets for the calling thread (thread-local, because the
simulated tier runs every rank as a thread of one process).  The groups are
captured by each autograd node in forward, so backward does not need the context.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from . import collectives as C
from .algorithms import BACKEND_ALGO, Algo
from .comm import Group
from .pending import all_reduce_lazy

__all__ = ["use_groups", "current_groups", "sb_shard", "sb_all_gather", "sb_all_reduce", "sb_all_reduce_lazy",
           "sb_reduce_scatter", "sb_all_to_all", "sb_to_partial", "sb_grad_all_reduce",
           "sb_grad_to_partial", "sb_halo", "sb_windowed"]

_local = threading.local()


@contextmanager
def use_groups(groups: Sequence[Group]) -> Iterator[list[Group]]:
    """Make ``groups`` (one per mesh axis) current in this thread; nests and restores."""
    prev = getattr(_local, "groups", None)
    _local.groups = list(groups)
    try:
        yield _local.groups
    finally:
        _local.groups = prev


def current_groups() -> list[Group]:
    """The groups set by the innermost :func:`use_groups` of this thread."""
    groups = getattr(_local, "groups", None)
    if groups is None:
        raise RuntimeError(
            "no soybean process groups are set in this thread: run the program inside "
            "`with soybean.runtime.use_groups(groups):` (groups from torch_groups(mesh) or "
            "ThreadWorld(mesh).groups(rank)), or through launch.run_threads")
    return groups


def _group(axis: int) -> Group:
    groups = current_groups()
    if not 0 <= axis < len(groups):
        raise IndexError(f"mesh axis {axis} out of range: the current groups cover {len(groups)} axes")
    return groups[axis]


def sb_shard(x: torch.Tensor, axis: int, dim: int, view: bool = False, back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """R -> S(dim) along mesh ``axis`` (``view``: a view of ``x`` where no gradient is needed).

    Here and below ``algo`` / ``back``: the algorithm (``runtime.algorithms``) of the forward collective and of
    its adjoint, as the plan chose them."""
    return C.shard_slice(x, _group(axis), dim, view, back)


def sb_all_gather(x: torch.Tensor, axis: int, dim: int, full: int, grad_partial: bool = False,
                  algo: Algo = BACKEND_ALGO, back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """S(dim) -> R along mesh ``axis``; ``full`` is the gathered length of ``dim``."""
    return C.all_gather(x, _group(axis), dim, full, grad_partial, algo, back)


def sb_all_reduce(x: torch.Tensor, axis: int, algo: Algo = BACKEND_ALGO) -> torch.Tensor:
    """P -> R along mesh ``axis``."""
    return C.all_reduce(x, _group(axis), algo)


def sb_all_reduce_lazy(x: torch.Tensor, axis: int) -> torch.Tensor:
    """P -> R along mesh ``axis``, the sum arriving while backward runs (``pending.PendingSum``)."""
    return all_reduce_lazy(x, _group(axis))


def sb_reduce_scatter(x: torch.Tensor, axis: int, dim: int, algo: Algo = BACKEND_ALGO,
                      back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """P -> S(dim) along mesh ``axis``."""
    return C.reduce_scatter(x, _group(axis), dim, algo, back)


def sb_all_to_all(x: torch.Tensor, axis: int, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim) along mesh ``axis``; ``full_src`` is the length of ``src_dim``."""
    return C.all_to_all(x, _group(axis), src_dim, dst_dim, full_src)


def sb_to_partial(x: torch.Tensor, axis: int) -> torch.Tensor:
    """R -> P along mesh ``axis``."""
    return C.to_partial(x, _group(axis))


def sb_grad_all_reduce(x: torch.Tensor, axis: int, back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """Identity forward, all_reduce of the gradient along mesh ``axis``."""
    return C.grad_all_reduce(x, _group(axis), back)


def sb_grad_to_partial(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Identity forward; the gradient is kept on member 0 of mesh ``axis`` only (made partial)."""
    return C.grad_to_partial(x, _group(axis))


def sb_halo(x: torch.Tensor, axis: int, dim: int, full: int, windows: C.Windows, fill: float = 0.0) -> torch.Tensor:
    """S(dim) -> my window ``windows[coordinate]`` of rows of the length-``full`` dim along mesh ``axis``
    (neighbours' rows by point-to-point, ``fill`` outside the tensor); backward returns the halo gradients."""
    return C.halo(x, _group(axis), dim, full, windows, fill)


def sb_windowed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a windowed op on halo windows, saving each window for backward as its halo rows only
    (``collectives.windowed_call``)."""
    return C.windowed_call(fn, *args, **kwargs)
