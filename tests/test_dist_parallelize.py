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


def _sgd_losses(model: torch.nn.Module, inputs: tuple, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _unet_inputs() -> tuple[torch.nn.Module, tuple]:
    from examples.models import unet

    model, inputs = unet(batch=1, image=16, channels=4)
    return model.double(), tuple(t.double() for t in inputs)


def _train_unet(rank: int, world: int) -> tuple[list[float], list[str]]:
    import soybean

    torch.set_num_threads(1)
    model, inputs = _unet_inputs()
    pm = soybean.parallelize(model, inputs, devices=world, objective="comm")
    split = [n for n, v in pm.plan.nodes.items() if n.startswith("conv2d") and "S(2)" in v["in"][0]]
    return _sgd_losses(pm, inputs, steps=3), split


@pytest.mark.dist
def test_gloo_spatial_unet_equals_serial() -> None:
    """Batch 1 on 2 gloo ranks: the plan splits the image (halo exchanges by point-to-point send/recv on the
    axis group, batch norm's statistics summed), and the losses of 3 SGD steps equal serial's."""
    model, inputs = _unet_inputs()
    ref = _sgd_losses(model, inputs, steps=3)
    for losses, split in spawn(_train_unet, 2, timeout_s=180):
        assert split, "no convolution was split spatially"
        assert losses == pytest.approx(ref, rel=1e-9)
