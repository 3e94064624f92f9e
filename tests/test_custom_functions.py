"""A custom ``torch.autograd.Function`` in the model: ``parallelize`` captures the model by dynamo in pieces cut at
the Function's call, which runs as written with its own backward (so a gradient reversal trains as serial); exported
whole it trains with its forward's derivative, and the user is told so by name (``soybean.capture.functions``)."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import soybean
from soybean.capture.core import capture
from soybean.capture.functions import CustomFunctionError, CustomFunctionWarning, own_backwards
from soybean.plan import Plan
from soybean.run.module import ParallelModule
from soybean.run.pieces import PiecesModule

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
    """Two layers with the Function ``fn`` between them."""

    fn: Any = _Reversal

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn.apply(self.a(x)))


class _Square(torch.autograd.Function):
    """A Function whose backward is its forward's derivative (as Bloom's ``GeLUFunction``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _Squared(_Reversed):
    fn = _Square


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


class _Flip(torch.autograd.Function):
    """A gradient reversal whose forward makes no op (it returns a view of its input): nothing of it is left in the
    exported graph, so only its call tells capture of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class _Flipped(_Reversed):
    fn = _Flip


def test_capture_records_the_functions_called_while_exporting_and_only_its_own_thread_s() -> None:
    """``Captured.functions``: the Functions the model called while it was exported, also one whose forward left no
    op; a Function another thread calls meanwhile is not this capture's, and ``apply`` is as before afterwards."""
    import threading

    from soybean.capture.functions import called_functions

    torch.manual_seed(0)
    x = torch.randn(4, 4)
    assert capture(_Flipped(), (x,)).functions == (f"{__name__}._Flip",)
    assert capture(_Straight(), (x,)).functions == ()
    with called_functions() as called:
        other = threading.Thread(target=lambda: _Square.apply(x))
        other.start()
        other.join()
        assert called == {}
        _Reversal.apply(x)
    assert list(called) == [f"{__name__}._Reversal"]
    assert "apply" not in vars(_Reversal) and "apply" not in vars(_Square)


def test_a_custom_function_runs_as_written_in_pieces_with_its_own_backward() -> None:
    torch.manual_seed(0)
    model, x = _Reversed(), torch.randn(4, 4)
    assert capture(model, (x,)).functions == (f"{__name__}._Reversal",)
    eager = _grads(model, list(model.parameters()), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CustomFunctionWarning)
        with pytest.warns(UserWarning, match=r"in 2 pieces .* custom torch.autograd.Function .*_Reversal, which "
                                             r"runs as written"):
            pm = soybean.parallelize(copy.deepcopy(model), (x,), devices=1)
    assert isinstance(pm, PiecesModule) and pm.plan.pieces is not None and "_Reversal" in pm.plan.pieces["why"]
    for g, w in zip(_grads(pm, list(pm.parameters()), x), eager):  # the first layer's gradient reversed, as eager's
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_compile_backend_runs_a_custom_function_dynamo_traces_with_its_own_backward() -> None:
    torch.manual_seed(0)
    model, x = _Reversed(), torch.randn(4, 4)
    eager = _grads(model, list(model.parameters()), x)
    backend = soybean.compile_backend(devices=1)
    compiled = copy.deepcopy(model)
    got = _grads(torch.compile(compiled, backend=backend), list(compiled.parameters()), x)
    assert len(backend.plans) == 2  # dynamo traced the Function into its graph: cut there, a plan on either side
    for g, w in zip(got, eager):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_exported_whole_a_custom_function_is_named_and_trains_with_its_forwards_derivative() -> None:
    torch.manual_seed(0)
    model, x = _Reversed(), torch.randn(4, 4)
    eager = _grads(model, list(model.parameters()), x)
    with pytest.warns(CustomFunctionWarning, match=r"_Reversal: captured by torch.export as asked \(capture_with="
                                                   r"'export'\), soybean trains the derivative of its forward"):
        pm = soybean.parallelize(copy.deepcopy(model), (x,), devices=1, capture_with="export")
    got = _grads(pm, list(pm.parameters()), x)
    # The limit the warning names: the first layer's gradient is the forward's derivative, eager's negated.
    torch.testing.assert_close(got[0], -eager[0])
    torch.testing.assert_close(got[2], eager[2])


def test_where_only_export_is_offered_a_backward_shown_to_differ_is_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    model, x = _Reversed(), torch.randn(4, 4)
    with pytest.raises(CustomFunctionError, match=r"_Reversal, whose backward is not the derivative of its forward "
                                                  r"\(checked on the example\): in precision bf16-mixed.* Fix:"):
        soybean.parallelize(model, (x,), devices=1, precision="bf16-mixed")


def test_a_function_whose_backward_is_its_forwards_derivative_is_exported_whole_and_silent() -> None:
    torch.manual_seed(0)
    model, x = _Squared(), torch.randn(4, 4)
    cap = capture(model, (x,))
    assert cap.functions == (f"{__name__}._Square",)
    assert own_backwards(model, (x,), {}, cap.functions) == {}
    assert own_backwards(_Reversed(), (x,), {}, (f"{__name__}._Reversal",)) == {f"{__name__}._Reversal": True}
    eager = _grads(model, list(model.parameters()), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm = soybean.parallelize(copy.deepcopy(model), (x,), devices=1)
    assert isinstance(pm, ParallelModule)
    for g, w in zip(_grads(pm, list(pm.parameters()), x), eager):
        torch.testing.assert_close(g, w)


def test_a_step_written_with_detach_is_exact_and_draws_no_warning() -> None:
    torch.manual_seed(0)
    model, x = _Straight(), torch.randn(4, 4)
    eager = _grads(model, list(model.parameters()), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CustomFunctionWarning)
        pm = soybean.parallelize(copy.deepcopy(model), (x,), devices=1)
    for g, w in zip(_grads(pm, list(pm.parameters()), x), eager):
        torch.testing.assert_close(g, w)


def reversed_model() -> tuple[torch.nn.Module, tuple]:
    """``_Reversed`` for the command line (``tests.test_custom_functions:reversed_model``), batch 8."""
    torch.manual_seed(0)
    return _Reversed(), (torch.randn(8, 4),)


def test_the_command_line_plans_a_model_with_its_own_backward_in_pieces(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """``soybean plan`` captures as ``parallelize`` does: in pieces, the reversal named as the reason; ``explain``
    reads the saved plan."""
    from soybean.cli import main

    torch._dynamo.reset()
    ref, out = "tests.test_custom_functions:reversed_model", tmp_path / "plan.json"
    assert main(["plan", ref, "--devices", "2", "--no-cache", "--quiet", "--out", str(out)]) == 0
    saved = Plan.load(out)
    assert saved.pieces is not None and "_Reversal, which runs as written" in saved.pieces["why"]
    capsys.readouterr()
    assert main(["explain", ref, "--plan", str(out)]) == 0
    assert capsys.readouterr().out.count("== piece ") == len(saved.pieces["graphs"]) == 2


def test_the_command_line_refuses_where_parallelize_would(capsys: pytest.CaptureFixture) -> None:
    """In bf16, where pieces are not offered, ``soybean plan`` stops with ``parallelize``'s error (one rule in
    ``capture.functions.pieces_or_whole``), not a plan that would train the forward's derivative."""
    from soybean.cli import main

    ref = "tests.test_custom_functions:reversed_model"
    assert main(["plan", ref, "--devices", "2", "--no-cache", "--quiet", "--precision", "bf16-mixed"]) != 0
    err = capsys.readouterr().err
    assert "soybean plan: error: _Reversed calls the custom torch.autograd.Function" in err
    assert "in precision bf16-mixed" in err and "Fix:" in err


@pytest.mark.dist
def test_the_sweeps_threads_tier_trains_a_model_parallelize_splits_into_pieces_on_processes() -> None:
    """``verify.sweep`` plans what ``parallelize`` would: a model whose exported graph calls a Function with its own
    backward trains in pieces on gloo processes, not as the export on threads (which trains the forward's
    derivative: YOSO was reported unequal to serial while ``parallelize`` trains it exactly)."""
    from soybean.verify import sweep

    row = sweep.sweep("tests.test_custom_functions:reversed_model", sweep.Row("reversed", "test", "regression"),
                      ("time",), devices=2, tier="threads")
    assert row.results == {"time": "ok"}, row.results
