"""Real multi-process run (gloo, 2 ranks): parallelize plans on rank 0, broadcasts, trains like serial."""
from __future__ import annotations

import pytest
import torch

from examples.models import mlp
from examples.train_mlp import fit
from soybean.runtime.launch import spawn

pytestmark = pytest.mark.dist


def _train(rank: int, world: int) -> list[float]:
    import soybean

    torch.set_num_threads(1)
    model, (x, y) = mlp(batch=8, hidden=16, layers=1)
    pm = soybean.parallelize(model, (x, y), devices=world, mode="mp")
    return fit(pm, x, y, steps=3)


def _wrong_world(rank: int, world: int) -> None:
    import soybean

    model, (x, y) = mlp(batch=8, hidden=16, layers=1)
    soybean.parallelize(model, (x, y), devices=4)


@pytest.mark.dist
def test_gloo_two_ranks_equal_serial() -> None:
    model, (x, y) = mlp(batch=8, hidden=16, layers=1)
    ref = fit(model, x, y, steps=3)
    got = spawn(_train, 2, timeout_s=120)
    for r in got:
        assert r == pytest.approx(ref, rel=1e-5)


@pytest.mark.dist
def test_wrong_world_size_fails_fast() -> None:
    with pytest.raises(Exception, match="world size is 2"):
        spawn(_wrong_world, 2, timeout_s=60)
