"""Optimizers over tiles (``soybean.run.optimizers``): one that reads whole weights is refused where the plan splits
them, one of unknown kind warned about once, an elementwise one left alone.  (A 2-process run of a split plan
refusing Adafactor on both ranks is ``test_module_api``'s.)"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn

from soybean.run.optimizers import OptimizerError, OptimizerWarning, verdict, watch

pytestmark = pytest.mark.unit


class _Split(nn.Linear):
    """A module whose plan splits its weight (what ``split_weights`` of a parallelized module says)."""

    def split_weights(self) -> list[str]:
        return ["weight"]


class _Signed(torch.optim.Optimizer):
    """An optimizer soybean does not know (a sign step): warned about, not refused."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-g["lr"])


def test_the_verdict_reads_the_optimizer_kind_and_the_split_weights() -> None:
    for kind in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop):
        assert verdict(kind, ["w"]) is None
    for kind in (torch.optim.Adafactor, torch.optim.Muon, torch.optim.LBFGS):
        assert verdict(kind, []) is None  # nothing split: every tile is a whole weight
        with pytest.raises(OptimizerError, match=f"{kind.__name__} updates each weight from statistics of the whole "
                                                 "weight, and this plan splits 4 trained weights \\(a, b, c and 1 "
                                                 "more\\).*Fix: parallelize\\(..., mode='replicated'\\)"):
            verdict(kind, ["a", "b", "c", "d"])
    why = verdict(_Signed, ["w"])
    assert why is not None and why.startswith("_Signed is not known to update each element")


def test_a_watched_module_checks_each_optimizer_once_at_its_first_step() -> None:
    torch.manual_seed(0)
    hooks = len(torch_optimizer._global_optimizer_pre_hooks)
    module = _Split(4, 4)
    watch(module)
    module(torch.randn(2, 4)).sum().backward()
    with pytest.raises(OptimizerError, match="Adafactor"):
        torch.optim.Adafactor(module.parameters()).step()
    torch.optim.AdamW(module.parameters()).step()  # elementwise: exact over tiles
    signed = _Signed(module.parameters())
    with pytest.warns(OptimizerWarning, match="_Signed is not known"):
        signed.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        signed.step()  # once per optimizer
        torch.optim.Adafactor(nn.Linear(4, 4).parameters()).step()  # not this module's parameters
    assert len(torch_optimizer._global_optimizer_pre_hooks) == hooks + 1
    del module, signed
    gc.collect()
    assert len(torch_optimizer._global_optimizer_pre_hooks) == hooks  # the hook went with the module
