"""Sharded checkpoints across plans and world sizes (gloo): the model's tiles and AdamW's moments reshard.

Hidden size 9 over 2 ranks: the split weights and biases are uneven tiles (5 and 4 rows), the case where DCP's
shard offsets and sizes must follow soybean's chunking.  A run saves (model, optimizer, step) under a plan that
splits every weight at 2 ranks and goes on; the same checkpoint loaded under a replicated plan at 2 ranks and
under another plan at 4 ranks continues with the losses of the run that went on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.models import mlp
from soybean.runtime.launch import spawn

pytestmark = pytest.mark.dist


HIDDEN = 9  # odd: over 2 ranks every split dim is cut 5 + 4
SAVED, STEPS = 2, 5  # save after step 2, compare steps 3..5


def _step(pm: Any, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(100 + step)
    loss = pm(torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _resume(pm: Any, path: str) -> list[float]:
    opt = torch.optim.AdamW(pm.parameters(), lr=0.05)
    extra = pm.load_sharded(path, optimizer=opt)
    return [_step(pm, opt, s) for s in range(extra["step"] + 1, STEPS + 1)]


def _save_then_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save under MP (uneven tiles) after step 2 and go on to step 5; then load under DP and resume."""
    import soybean

    model, (x, y) = mlp(batch=8, hidden=HIDDEN, layers=1)
    a = soybean.parallelize(model, (x, y), devices=world, mode="mp")  # weights and biases split
    opt = torch.optim.AdamW(a.parameters(), lr=0.05)
    for s in range(SAVED + 1):
        _step(a, opt, s)
    want = a.full_state_dict()
    a.save_sharded(path, optimizer=opt, extra={"step": SAVED})
    losses = [_step(a, opt, s) for s in range(SAVED + 1, STEPS + 1)]
    other, _ = mlp(batch=8, hidden=HIDDEN, layers=1, seed=3)
    b = soybean.parallelize(other, (x, y), devices=world, mode="dp")  # replicated
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.05)
    b.load_sharded(path, optimizer=opt_b)
    loaded = b.full_state_dict()
    c, _ = mlp(batch=8, hidden=HIDDEN, layers=1, seed=4)
    return {"losses": losses, "dp": _resume(soybean.parallelize(c, (x, y), devices=world, mode="dp"), path),
            "equal": all(torch.equal(loaded[k], v) for k, v in want.items()),
            "shapes": [tuple(p.shape) for p in a.parameters()],
            "moments": [tuple(s["exp_avg"].shape) for s in opt.state.values()]}


def _load_at(rank: int, world: int, path: str) -> tuple[list[float], list[int]]:
    import soybean

    model, (x, y) = mlp(batch=8, hidden=HIDDEN, layers=1, seed=5)
    pm = soybean.parallelize(model, (x, y), devices=world, objective="comm")
    return _resume(pm, path), list(pm.plan.mesh)


@pytest.mark.dist
def test_checkpoint_with_optimizer_loads_under_other_plans_and_world_sizes(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    two = spawn(_save_then_load, 2, path, timeout_s=120)
    assert [r["equal"] for r in two] == [True, True]
    shapes0, shapes1 = two[0]["shapes"], two[1]["shapes"]
    assert any(s0 != s1 for s0, s1 in zip(shapes0, shapes1, strict=True)), f"even tiles: {shapes0}"
    assert two[0]["moments"] != two[1]["moments"]  # AdamW's moments were uneven tiles too
    want = two[0]["losses"]
    torch.testing.assert_close(two[0]["dp"], want, rtol=1e-5, atol=1e-6)
    four = spawn(_load_at, 4, path, timeout_s=180)
    losses, mesh = four[0]
    assert mesh and mesh != [2] and all(r[0] == losses for r in four)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
