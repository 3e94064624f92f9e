"""A sum across devices that is still in flight: the loss all-reduce, hidden behind backward.

A full-batch loss is computed as a pending sum ``P`` and all-reduced at the very end of forward,
so that every rank returns the serial loss.  Blocking there costs a network round trip (and the
wait for the slowest rank) although nothing in backward reads the value: the gradient of a sum's
summands is the replicated incoming gradient (identity, see ``collectives._AllReduce``).

``all_reduce_lazy`` therefore starts the all-reduce asynchronously and returns a
:class:`PendingSum`: a tensor whose every *value* access (any torch function or method on it:
``item``, ``float``, arithmetic, ``print``, ``detach`` ...) first waits for the sum, while
metadata (shape, dtype, ``grad_fn`` ...) and ``backward`` do not wait.  ``loss.backward()`` thus
overlaps the all-reduce; the value is exact whenever it is read.  Ops on a ``PendingSum`` return
plain tensors.  Every pending sum is kept by the group it runs on (``AsyncGroup.in_flight``) and waited for at the
start of the module's next forward (:func:`wait_all`), so none outlives its step, and at exit (the group's own
``comm.wait_in_flight``).  Code that reads the storage without a torch
function (a ``torch.distributed`` call on the loss itself) calls ``loss.wait()`` first.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch.autograd import Function
from torch.utils._pytree import tree_flatten

from .collectives import all_reduce
from .comm import AsyncGroup, Group, Work

__all__ = ["PendingSum", "all_reduce_lazy", "wait_all"]

# Accesses that do not read the value: tensor properties, and methods of metadata or autograd.
_NO_WAIT = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "grad", "ndim", "layout", "is_cuda", "is_sparse",
    "is_quantized", "is_meta", "names", "_base", "_version", "output_nr", "_backward_hooks",
    "dim", "ndimension", "size", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "backward",
    "register_hook", "retain_grad", "requires_grad_", "__hash__", "__len__",
})

class PendingSum(torch.Tensor):
    """A tensor whose value is a cross-device sum started asynchronously (see the module docstring)."""

    _sb_finish: Callable[[], None] | None

    def wait(self) -> None:
        """Block until the sum has arrived (idempotent)."""
        finish = self.__dict__.pop("_sb_finish", None)
        if finish is not None:
            finish()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: its name is the descriptor's
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if name not in _NO_WAIT:
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, PendingSum):
                    a.wait()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class _StartSum(Function):
    """Forward: a copy of ``x`` whose in-place all-reduce has been started; backward: identity
    (the adjoint of P -> R, as for ``collectives._AllReduce``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AsyncGroup, handles: list[Work]) -> torch.Tensor:
        buf = x.detach().contiguous().clone()
        handles.append(group.all_reduce_inplace_async(buf))
        return buf

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g, None, None


def all_reduce_lazy(x: torch.Tensor, group: Group) -> torch.Tensor:
    """P -> R like ``collectives.all_reduce``, returning at once a :class:`PendingSum`.

    Groups without asynchronous collectives (the thread tier) sum at once.
    """
    if group.size == 1:
        return x
    if getattr(group, "all_reduce_inplace_async", None) is None:
        return all_reduce(x, group)
    handles: list[Work] = []
    out = _StartSum.apply(x, group, handles).as_subclass(PendingSum)
    out._sb_finish = handles[0].wait
    cast(AsyncGroup, group).in_flight.append(out)  # kept by the group until waited for (``wait_all``, at exit)
    return out


def wait_all(groups: Iterable[Group]) -> None:
    """Wait for every pending sum started on ``groups`` and not yet waited for (a module calls this with its own
    groups at each forward)."""
    for g in groups:
        pending = getattr(g, "in_flight", None)
        while pending:
            pending.pop().wait()
