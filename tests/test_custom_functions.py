"""A custom ``torch.autograd.Function`` in the model: captured as its forward's ops, it trains with their
derivative, and the user is told so by name (``soybean.capture.functions``)."""
from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import soybean
from soybean.capture.core import capture
from soybean.capture.functions import CustomFunctionWarning, custom_functions

pytestmark = pytest.mark.unit


class _Reversal(torch.autograd.Function):
    """A gradient reversal (domain adaptation): identity forward, ``-grad`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class _Reversed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Reversal.apply(self.a(x)))


class _Straight(torch.nn.Module):
    """The same kind of step written with ``detach`` (a straight-through rounding): the captured graph keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + (torch.round(h * 4) / 4 - h).detach())


def _grads(run: Any, params: list[torch.nn.Parameter], x: torch.Tensor) -> list[torch.Tensor]:
    run(x).sum().backward()
    return [p.grad.clone() for p in params]


def test_a_custom_function_is_named_and_trains_with_its_forwards_derivative() -> None:
    torch.manual_seed(0)
    model, x = _Reversed(), torch.randn(4, 4)
    assert custom_functions(capture(model, (x,)).graph_module) == [_Reversal]
    eager = _grads(model, list(model.parameters()), x)
    with pytest.warns(CustomFunctionWarning, match=r"_Reversal: soybean trains the derivative of its forward"):
        pm = soybean.parallelize(copy.deepcopy(model), (x,), devices=1)
    got = _grads(pm, list(pm.parameters()), x)
    # The limit the warning names: the first layer's gradient is the forward's derivative, eager's negated.
    torch.testing.assert_close(got[0], -eager[0])
    torch.testing.assert_close(got[2], eager[2])


def test_a_step_written_with_detach_is_exact_and_draws_no_warning() -> None:
    torch.manual_seed(0)
    model, x = _Straight(), torch.randn(4, 4)
    eager = _grads(model, list(model.parameters()), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CustomFunctionWarning)
        pm = soybean.parallelize(copy.deepcopy(model), (x,), devices=1)
    for g, w in zip(_grads(pm, list(pm.parameters()), x), eager):
        torch.testing.assert_close(g, w)
