"""Pipeline stages run the model on microbatches: where its rows are not independent that trains another model.
``soybean.run.microbatches`` finds such models on the example (the refusal on every rank of a 2-process
``parallelize`` is ``test_rank_errors``')."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from soybean.run.microbatches import MicrobatchError, MicrobatchWarning, check, difference

pytestmark = pytest.mark.unit


class _Swap(nn.Module):
    """Doge's router in small: the batch ``[B, D]`` viewed as ``[2, B, D/2]`` (each half of the batch's memory, not
    of each row) and the halves swapped, so row ``i`` of the output reads another sample's features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(2, x.shape[0], -1).flip(0).reshape(x.shape[0], -1)


def mixed(batch: int = 8, hidden: int = 16, layers: int = 4) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """An MLP with ``_Swap`` after its first layer (``tests.test_microbatches:mixed`` for the command line)."""
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(hidden, hidden), nn.Tanh(), _Swap()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*mods), (torch.randn(batch, hidden),)


def test_a_model_that_mixes_rows_of_the_batch_is_found_and_refused() -> None:
    model, (x,) = mixed()
    why = difference(model, (x,), {}, 2)
    assert why is not None and "differs from its outputs on 2 microbatches of 4" in why
    assert difference(model, (x,), {}, 1) is None  # one microbatch is the batch
    plain = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    assert difference(plain, (x,), {}, 2) is None and difference(plain, (x,), {}, 4) is None
    with torch.device("meta"):
        on_meta = nn.Sequential(nn.Linear(16, 16), _Swap())
    assert difference(on_meta, (x.to("meta"),), {}, 2) is None  # cannot run: not checked
    with pytest.raises(MicrobatchError, match="Sequential does not compute the same on microbatches.*Fix: "
                                              "microbatches=1"):
        check(why, "Sequential", 2)
    check(None, "Sequential", 2)


def test_batch_norm_in_training_is_named_and_the_check_leaves_no_trace() -> None:
    """Batch norm couples rows only in training (evaluation mode, in which the outputs are compared, hides it): it is
    found by its modules.  The check restores the model's modes, buffers and random state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    why = difference(model, (x,), {}, 2)
    assert why is not None and "1 (BatchNorm1d)" in why
    model.eval()
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    assert difference(model, (x,), {}, 2) is None  # running statistics: rows independent (dropout off)
    model.train()
    model[1].eval()
    assert difference(model, (x,), {}, 2) is None  # dropout draws per slice, but is not the model's meaning
    assert model.training and model[2].training and not model[1].training
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)


def test_transformers_doge_mixes_rows_and_llama_does_not() -> None:
    """transformers' Doge with its mixture of experts views its router logits ``[B, S, 2K]`` as ``[2, B S, K]``; its
    pipelined training differed from serial with no error before this check."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    x = torch.randint(0, 100, (4, 16))
    doge = tf.DogeForCausalLM(tf.DogeConfig(**small, is_moe=True, num_experts=16, num_experts_per_tok=4))
    assert (why := difference(doge, (x,), {}, 2)) is not None and "shape (4, 16, 100)" in why
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    assert difference(llama, (x,), {"attention_mask": torch.ones_like(x)}, 2) is None


def test_auto_searches_no_stages_for_a_model_that_mixes_rows(capsys: pytest.CaptureFixture) -> None:
    """``--pipeline auto`` (``api.auto_plan``) plans without stages, with one warning and the reason in the plan."""
    from soybean.cli import main

    args = ["plan", "tests.test_microbatches:mixed", "--devices", "2", "--profile", "h100-nvlink-ib",
            "--gpus-per-node", "1", "--pipeline", "auto", "--format", "json", "--quiet"]
    with pytest.warns(MicrobatchWarning, match="searched no pipeline stages: Sequential"):
        assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert "pipeline" not in got and got["solver"]["pipelines_searched"] == []
    assert "differs from its outputs on 2 microbatches" in got["solver"]["no_pipeline"]
