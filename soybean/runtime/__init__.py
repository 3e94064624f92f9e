"""Communication runtime: groups, differentiable collectives, the per-thread context, launchers.

* :mod:`.comm` -- the :class:`Group` protocol; :class:`ThreadWorld`/:class:`ThreadGroup`
  (ranks as threads of one process) and :class:`TorchGroup`/:func:`torch_groups`
  (``torch.distributed``).
* :mod:`.collectives` -- every layout change as an ``autograd.Function`` with its adjoint.
* :mod:`.context` -- :func:`use_groups` and the axis-based ``sb_*`` calls of generated programs.
* :mod:`.launch` -- :func:`spawn`, :func:`init_from_env`, :func:`run_threads`.
"""
from .collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    grad_all_reduce,
    grad_to_partial,
    halo,
    reduce_scatter,
    shard_slice,
    to_partial,
)
from .comm import Group, ThreadGroup, ThreadWorld, TorchGroup, torch_groups
from .context import (
    current_groups,
    sb_all_gather,
    sb_all_reduce,
    sb_all_to_all,
    sb_grad_all_reduce,
    sb_grad_to_partial,
    sb_halo,
    sb_reduce_scatter,
    sb_shard,
    sb_to_partial,
    sb_windowed,
    use_groups,
)
from .launch import default_backend, init_from_env, run_threads, spawn

__all__ = [
    "Group", "ThreadGroup", "ThreadWorld", "TorchGroup", "torch_groups",
    "shard_slice", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "to_partial", "grad_all_reduce",
    "grad_to_partial", "halo",
    "use_groups", "current_groups", "sb_shard", "sb_all_gather", "sb_all_reduce", "sb_reduce_scatter",
    "sb_all_to_all", "sb_to_partial", "sb_grad_all_reduce", "sb_grad_to_partial", "sb_halo",
    "sb_windowed", "spawn", "init_from_env", "run_threads", "default_backend",
]
