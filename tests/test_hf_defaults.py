"""Hugging Face models as users load them (default configs, ``use_cache=True``), the loss outside the model.

``hf:`` references set ``use_cache=False``; a user's model does not.  Its forward then returns a KV cache
(``DynamicCache``, an object no pytree knows) and builds it from empty tensors that ``torch.export``
lifts as constants.  Capture drops the cache from the outputs and creates the empty constants in the
graph (``capture._plain_outputs``, ``capture.passes.inline_empty_constants``); the parallel model returns the
model's own output type (``CausalLMOutputWithPast`` / ``BaseModelOutput...``, cache ``None``).  On 2 ranks
(threads) a loop that computes cross-entropy from ``out.logits`` outside the model trains like serial.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from soybean.api import parallelize
from soybean.mesh import Mesh
from soybean.planner.core import plan as make_plan
from soybean.runtime.launch import run_threads

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.sim

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 64}
CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16),
}


def _steps(model: torch.nn.Module, ids: torch.Tensor, steps: int = 2) -> tuple[list[float], type]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, kind = [], type(None)
    for _ in range(steps):
        out = model(ids)
        kind = type(out)
        loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, kind


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_default_config_with_loss_outside_trains_like_serial(name: str) -> None:
    cfg = CONFIGS[name]()
    assert cfg.use_cache  # as users load it
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (4, 8))
    serial, serial_kind = _steps(copy.deepcopy(model), ids)
    plan = make_plan(model, (ids,), devices=2, baselines=False)

    def rank_fn(rank: int, groups: list) -> tuple:
        return _steps(parallelize(model, (ids,), plan=plan, rank=rank, groups=groups), ids)

    for losses, kind in run_threads(Mesh(tuple(plan.mesh)), rank_fn):
        assert kind is serial_kind  # the model's own output type, not a bare tensor
        assert losses == pytest.approx(serial, rel=1e-4)
