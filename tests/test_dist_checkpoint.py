"""A sharded checkpoint written under one plan loads under another (gloo, 2 ranks)."""
from __future__ import annotations

import pytest
import torch

from examples.models import mlp
from soybean.runtime.launch import spawn

pytestmark = pytest.mark.dist


def _save_then_load(rank: int, world: int, path: str) -> bool:
    import soybean

    model, (x, y) = mlp(batch=8, hidden=10, layers=1)
    a = soybean.parallelize(model, (x, y), devices=world, mode="mp")  # weights split (uneven: 10 over 2 is even, biases too)
    for p in a.parameters():
        with torch.no_grad():
            p.add_(1.0)  # something the serial model does not have
    want = a.full_state_dict()
    a.save_sharded(path)
    other, _ = mlp(batch=8, hidden=10, layers=1, seed=3)
    b = soybean.parallelize(other, (x, y), devices=world, mode="dp")  # weights replicated
    b.load_sharded(path)
    got = b.full_state_dict()
    return all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.dist
def test_checkpoint_loads_under_another_plan(tmp_path) -> None:
    assert spawn(_save_then_load, 2, str(tmp_path / "ckpt"), timeout_s=120) == [True, True]
