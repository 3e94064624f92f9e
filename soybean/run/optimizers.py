"""Optimizers over tiles: exact for those that update each element from its own state, not for the others.

A parallelized module's ``parameters()`` are this rank's tiles.  An optimizer that updates every element from that
element's gradient and state alone (SGD, Adam, AdamW, Adagrad, RMSprop, ...) does over the tiles exactly what it does
serially over the weights.  One that reads a statistic of a whole weight does not: Adafactor's row and column
moments, Muon's orthogonalisation of each matrix, LAMB's and LARS' trust ratio ``||w|| / ||update||``, L-BFGS'
dot products over every parameter.  Over a split weight's tile each is the
tile's statistic, and training is another model's, with no error anywhere.

So the module ``parallelize`` returns watches the optimizers stepped on it (``watch``: one step pre-hook common to
every optimizer, ``torch.optim.optimizer.register_optimizer_step_pre_hook``, removed with the module), once per
optimizer, at its first step: where the plan splits a trained weight, an optimizer known to read whole weights
(``WHOLE``) is an ``OptimizerError`` naming the fix (``mode="replicated"``: every weight stored whole on every device,
its use still split, so any optimizer sees whole weights), and one of unknown kind a single ``OptimizerWarning``.
The decision reads only the plan (the same on every rank) and the optimizer's class, so every rank raises alike.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# Optimizers whose update of an element reads only that element's gradient and state.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.SparseAdam)
# Optimizers (by class name: torch's and the common ones of other libraries) that read statistics of whole weights.
# (8-bit optimizers quantise their state in blocks of elements, which tiles cut elsewhere: approximate by design,
# they get the warning.)
WHOLE = frozenset({"Adafactor", "Muon", "LBFGS", "Lamb", "LAMB", "FusedLAMB", "Lars", "LARS", "Shampoo", "SOAP"})


class OptimizerError(ValueError):
    """The optimizer reads statistics of whole weights and the plan splits some: over tiles it trains another model."""


class OptimizerWarning(UserWarning):
    """The optimizer is of a kind not known to update element by element: over split weights it may differ."""


class Watched(Protocol):
    def split_weights(self) -> list[str]: ...

    def parameters(self, recurse: bool = ...) -> Any: ...


def verdict(kind: type, split: Sequence[str]) -> str | None:
    """``OptimizerError`` for an optimizer of class ``kind`` known to read whole weights when ``split`` (the trained
    weights the plan splits) is not empty; the warning's text for one of unknown kind; None when it is exact."""
    if not split or issubclass(kind, ELEMENTWISE):
        return None
    some = ", ".join(split[:3]) + (f" and {len(split) - 3} more" if len(split) > 3 else "")
    if kind.__name__ in WHOLE:
        raise OptimizerError(
            f"{kind.__name__} updates each weight from statistics of the whole weight, and this plan splits "
            f"{len(split)} trained weights ({some}): over this rank's tiles it would train another model than the "
            f"serial one. Fix: parallelize(..., mode='replicated') (every weight stored whole on every device, its "
            f"use still split), or an optimizer that updates element by element (SGD, Adam, AdamW, ...)")
    return (f"{kind.__name__} is not known to update each element from its own gradient and state alone; this plan "
            f"splits {len(split)} trained weights ({some}), and an optimizer that reads a statistic of a whole weight "
            f"(a norm, a factored moment, an orthogonalisation) reads a tile's instead. parallelize(..., "
            f"mode='replicated') stores every weight whole")


def watch(module: Watched) -> None:
    """Check each optimizer stepped on ``module``'s parameters once, at its first step (``verdict``); the hook goes
    with the module."""
    split = module.split_weights()
    if not split:
        return
    mine = {id(p) for p in module.parameters()}
    seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt in seen:
            return None
        seen.add(opt)
        if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            if (why := verdict(type(opt), split)) is not None:
                warnings.warn(why, OptimizerWarning, stacklevel=3)
        return None

    weakref.finalize(module, register_optimizer_step_pre_hook(hook).remove)
