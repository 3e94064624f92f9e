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
