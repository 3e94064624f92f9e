"""Measured memory: the peak of live tensor bytes during one training step on CPU.

``LiveBytes`` is a ``TorchDispatchMode`` that sees every tensor an aten op returns, forward and
backward alike (the autograd engine runs CPU backward on the calling thread, inside the mode), and
counts each storage once: its ``nbytes`` when it first appears, taken off again by a ``weakref``
finalizer when the storage is freed (PyTorch keeps a storage's Python object alive as long as the
storage, so the finalizer runs exactly then).  Views share their base's storage and add nothing.
Tensors made before the mode (parameters, the optimizer's states, the batch) are registered by
hand with ``track``.

``measure_step`` runs one warm-up AdamW step (so that the optimizer's states exist, as in every step
after the first), then measures the next: ``loss = model(*inputs)``, ``loss.backward()``,
``opt.step()``, ``opt.zero_grad()`` (gradients set to ``None``, PyTorch's default).  A mode is per
thread: a rank run as a thread measures itself by calling ``measure_step`` in that thread.

This is the yardstick ``cost.memory``'s model is checked against (``tests/test_memory_model.py``).
"""
from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes (each storage once) and their peak, for the ops run inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}   # storage data_ptr -> nbytes
        self.current = 0
        self.peak = 0

    def track(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (non-tensors are skipped) if they are not counted yet."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n == 0 or ptr in self.live:
                continue
            self.live[ptr] = n
            self.current += n
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._free, ptr)

    def _free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out))
        return out


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one measured training step.

    ``peak``: the most live at any moment (the figure a memory model must predict); ``before``: live
    before the forward (parameters, optimizer states, batch, buffers); ``forward_end``: live right
    after the forward (``before`` plus what autograd saved for backward and the loss);
    ``params``/``states``: bytes of the parameters and of the optimizer's states.
    """

    peak: int
    before: int
    forward_end: int
    params: int
    states: int


def _loss(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(out, torch.Tensor):
        return out.float().pow(2).mean()
    raise TypeError("measure_step needs a model returning a tensor (its loss, or an output to square)")


def measure_step(model: torch.nn.Module, inputs: tuple, *, lr: float = 1e-3,
                 optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW) -> StepMemory:
    """Live tensor bytes of the second training step of ``model`` on ``inputs`` (see the module doc).

    ``model`` is trained in place (two steps); pass a copy to keep it.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params, lr=lr)
    _loss(model(*inputs)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    gc.collect()
    mode = LiveBytes()
    mode.track(params)
    n_params = mode.current
    mode.track(states)
    n_states = mode.current - n_params
    mode.track(list(model.buffers()) + list(tree_leaves(inputs)))
    before = mode.current
    mode.reset_peak()
    was = gc.isenabled()
    gc.disable()  # no collector pass mid-step: what is live is what reference counting keeps
    try:
        with mode:
            loss = _loss(model(*inputs))
            forward_end = mode.current
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        if was:
            gc.enable()
    return StepMemory(mode.peak, before, forward_end, n_params, n_states)
