"""Causal attention split along the query sequence (issue 23, first part): each tile's causal mask offset by its
first row (``runtime.attention``), priced with the last rows' extra work (``ir.attention.causal_skew``), recorded in
the plan's ``context_parallel`` rows, and training equal to serial."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from soybean.capture import capture
from soybean.ir.attention import causal_skew
from soybean.planner import plan
from soybean.testing import train_parallel_threads, train_serial

pytestmark = pytest.mark.unit


class CausalAttention(nn.Module):
    """One head of causal self-attention over a batch of one long sequence: only its rows can split it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)).square().mean()


def test_causal_skew_is_the_busiest_chunks_share_of_the_causal_work() -> None:
    """Rows 0-1 of 4 attend to 1 + 2 keys, rows 2-3 to 3 + 4: the last chunk does 7 of 10, 1.4x an even half."""
    assert causal_skew(4, 4, 2) == pytest.approx(1.4)
    assert causal_skew(4, 4, 1) == 1.0
    assert causal_skew(8, 8, 4) == pytest.approx((7 + 8) * 4 / 36)


@pytest.mark.sim
@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_query_rows_split_train_as_serial(mesh: tuple[int, ...]) -> None:
    """Batch 1 x 66 tokens (uneven on 4), float64, under the plan that minimises communication: the attention's query
    rows are split (``context_parallel`` rows of the plan), and a few AdamW steps equal serial training."""
    torch.manual_seed(0)
    model = CausalAttention().double()
    x = torch.randn(1, 66, 16, dtype=torch.float64)
    cap = capture(model, (x,))
    p = plan(None, (), captured=cap, devices=len(mesh) * 2 if len(mesh) > 1 else 2, mesh=mesh, objective="comm",
             baselines=False)
    assert p.context_parallel and all(r["method"] == "all_gather_kv" for r in p.context_parallel)
    assert max(r["degree"] for r in p.context_parallel) >= 2 and "context_parallel" in p.to_dict()
    serial = train_serial(model, (x,), steps=3)
    par, _ = train_parallel_threads(model, (x,), plan=p, steps=3)
    torch.testing.assert_close(torch.tensor(par.losses), torch.tensor(serial.losses), rtol=1e-10, atol=1e-12)
    for k, v in serial.params.items():
        torch.testing.assert_close(par.params[k], v, rtol=1e-9, atol=1e-12)


_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, batch=1, seq=256)


def _llama_rank(rank: int, world: int, context_parallel: object) -> tuple:
    """One gloo rank: the tiny Llama parallelized with ``context_parallel``, trained; its trace and plan's rows."""
    import soybean
    from soybean.models import load
    from soybean.testing import Trace, _gather_grads, _train

    torch.set_num_threads(1)
    model, inputs = load("hf:llama", _LLAMA)
    pm = soybean.parallelize(model, inputs, devices=world, context_parallel=context_parallel)
    losses, grads = _train(pm, inputs, 3, 1e-4, _gather_grads)
    full = pm.full_tensors()
    names = {k for k, _ in model.named_parameters()}
    trace = Trace(losses, grads, {k: v for k, v in full.items() if k in names},
                  {k: v for k, v in full.items() if k not in names})
    return trace, pm.plan.context_parallel


@pytest.mark.dist
def test_a_causal_llama_with_context_parallel_2_trains_as_serial_on_gloo() -> None:
    """Issue 23's first point on 2 gloo processes: a tiny causal Llama (transformers, batch 1 x 256 tokens) with
    ``context_parallel=2`` splits both attention ops' query sequence 2 ways, and three AdamW steps equal serial
    training (every loss, gradient and parameter, judged against the float64 run)."""
    pytest.importorskip("transformers")
    from soybean.models import load
    from soybean.runtime.launch import spawn
    from soybean.sweep import differences, exact_serial

    par, rows = spawn(_llama_rank, 2, 2, timeout_s=600)[0]
    assert len(rows) == 2 and all(r["degree"] == 2 and r["method"] == "all_gather_kv" for r in rows)
    model, inputs = load("hf:llama", _LLAMA)
    serial = train_serial(model, inputs, steps=3, lr=1e-4)
    assert not differences(serial, exact_serial(model, inputs, serial, lr=1e-4), par, lr=1e-4)


def test_context_parallel_none_forbids_and_n_forces_the_split() -> None:
    """``none``: no attention op splits its rows even where the objective would; ``N`` on a mesh with no N-way
    axes: that mesh is refused with a message naming the option."""
    torch.manual_seed(0)
    model = CausalAttention().double()
    cap = capture(model, (torch.randn(1, 66, 16, dtype=torch.float64),))
    assert not plan(None, (), captured=cap, devices=2, objective="comm", context_parallel="none",
                    baselines=False).context_parallel
    assert plan(None, (), captured=cap, devices=2, context_parallel=2, baselines=False).context_parallel
    with pytest.raises(Exception, match="--context-parallel 2"):
        plan(None, (), captured=cap, devices=3, mesh=(3,), context_parallel=2, baselines=False)
    with pytest.raises(ValueError, match="--context-parallel"):
        plan(None, (), captured=cap, devices=2, context_parallel=1, baselines=False)
