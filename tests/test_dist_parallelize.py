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


def _both(rank: int, world: int) -> tuple[list[float], tuple[list[float], list[str]]]:
    """Both cases in turn on this one process group (their start-up was most of each run)."""
    return _train(rank, world), _train_unet(rank, world)


@pytest.mark.dist
def test_gloo_two_ranks_equal_serial_and_split_a_unet_spatially() -> None:
    """An MLP, model-parallel on 2 gloo ranks: the losses of 3 steps equal serial's.  Then a U-Net at batch 1 on the
    same ranks: the plan splits the image (halo exchanges by point-to-point send/recv on the axis group, batch
    norm's statistics summed), and the losses of 3 SGD steps equal serial's."""
    model, (x, y) = mlp(batch=8, hidden=16, layers=1)
    ref = fit(model, x, y, steps=3)
    unet, inputs = _unet_inputs()
    unet_ref = _sgd_losses(unet, inputs, steps=3)
    for mlp_losses, (losses, split) in spawn(_both, 2, timeout_s=300):
        assert mlp_losses == pytest.approx(ref, rel=1e-5)
        assert split, "no convolution was split spatially"
        assert losses == pytest.approx(unet_ref, rel=1e-9)
