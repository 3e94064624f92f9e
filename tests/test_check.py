"""``soybean check``: every strategy of every rule a model uses, run on simulated ranks against the serial op.

It must pass on a model whose rules are right (here a Llama-3 written as torchtitan writes it: complex rotary
embeddings, grouped-query attention by expand and reshape), and it must catch a rule that is wrong: one made
wrong on purpose in its forward (RMSNorm split along the dim it normalises over; relu of a pending sum), and
one whose forward is right but whose gradient convention is not (a replicated input of an op that splits no
work summed as if it did).
"""
from __future__ import annotations

import pytest
import torch

from examples.models import llama3, mlp
from soybean import cli
from soybean.verify.check import check_model
from soybean.rules.base import REGISTRY, RuleEntry, Strategy, Strategy1D
from soybean.verify.validate import check_op
from soybean.tiling import Partial, Replicate, Shard

pytestmark = pytest.mark.unit

aten = torch.ops.aten


def test_every_rule_of_a_torchtitan_style_llama_is_exact() -> None:
    model, inputs = llama3(seq=9, vocab=64, dim=32, ffn=64)
    report = check_model(model, inputs, devices=2)
    assert report.ok, "\n".join(report.lines())
    assert report.strategies > report.ops > 20 and not report.unruled and report.dtype == "float64"
    assert "aten.view_as_complex.default" not in report.unruled


def test_a_broken_rule_is_caught_with_its_op_and_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm normalises over its last dim: splitting that dim (and the weight) normalises each chunk alone."""
    name = "aten.rms_norm.default"
    entry = REGISTRY[name]

    def broken(op):  # the right strategies plus the wrong one
        last = op.inputs[0].ndim - 1
        return [*entry.fn(op), Strategy1D((Shard(last), Shard(0)), (Shard(last),))]

    monkeypatch.setitem(REGISTRY, name, RuleEntry(broken, entry.localize, entry.family, entry.cost))
    model, inputs = llama3(seq=9, vocab=64, dim=32, ffn=64, layers=1)
    report = check_model(model, inputs, devices=2)
    assert not report.ok
    bad = {f.message.split(" strategy")[0] for f in report.failures}
    assert bad == {"aten.rms_norm.default"}, report.lines()
    assert all("in=[['S(2)'], ['S(0)']] out=[['S(2)']]" in f.message for f in report.failures)  # that one only


def test_the_cli_exits_1_on_a_broken_rule_and_0_without(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", "examples.models:mlp", "--arg", "batch=6", "--arg", "hidden=10", "--arg", "layers=1",
            "--devices", "4", "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "on mesh 4, 2x2" in out and "every strategy is exact" in out
    name = "aten.relu.default"
    entry = REGISTRY[name]
    # relu is not linear: relu(P) != P
    wrong = RuleEntry(lambda op: [*entry.fn(op), Strategy1D((Partial(),), (Partial(),))], entry.localize,
                      entry.family, entry.cost)
    monkeypatch.setitem(REGISTRY, name, wrong)
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "aten.relu.default strategy in=[['P']] out=[['P']]" in out


def test_the_gradient_convention_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``type_as(self R, other S)``: every device computes the whole output, so ``self``'s gradient is whole on
    each; counting ``other``'s split as split work would sum it twice.  Only the backward shows it."""
    args = (torch.randn(6, 5), torch.randn(6, 5, dtype=torch.float64))
    assert check_op(aten.type_as.default, args) > 1

    def split_axes(self: Strategy) -> tuple[bool, ...]:  # the old convention: any split tensor counts
        n = len(self.outputs[0])
        return tuple(any(not isinstance(t[a], Replicate) for t in self.inputs + self.outputs) for a in range(n))

    monkeypatch.setattr(Strategy, "split_axes", split_axes)
    with pytest.raises(AssertionError, match="gradient of input 0 wrong"):
        check_op(aten.type_as.default, args)
    assert check_op(aten.type_as.default, args, backward=False) > 1  # the forward alone cannot tell


def test_a_model_on_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        model, inputs = mlp(batch=4, hidden=8, layers=1)
    with pytest.raises(ValueError, match="meta device"):
        check_model(model, inputs)
