"""Domain parallelism end to end: the planner splits images and volumes, and training equals serial.

A two-level U-Net (padded convs with batch norm in training mode, max-pool, transposed-conv
upsampling, skip concatenation) and a 3-D conv net (strided and dilated 3-D convs, average pooling,
nearest upsampling) at batch 1 cannot use data parallelism: the planner (objective ``comm``) splits
their spatial dims, on one axis of 4 or on both axes of 2x2 (H and W), and at batch 2 on 2x2 batch
and space (Gholami's grid).  Every rank runs as a thread; the loss, every gradient, the parameters
after SGD steps and batch norm's running statistics equal serial training's (float64, so the sums
taken in another order agree to 1e-9).
"""
from __future__ import annotations

import pytest
import torch

from examples.models import unet, volume_net
from soybean.planner import plan as make_plan
from soybean.rules.window import spatial_splits
from soybean.testing import compare, train_parallel_threads, train_serial

pytestmark = pytest.mark.sim


def _model(name: str, batch: int) -> tuple[torch.nn.Module, tuple]:
    model, inputs = unet(batch=batch, image=20, channels=4) if name == "unet" else volume_net(batch=batch, volume=16,
                                                                                           channels=4)
    return model.double(), tuple(x.double() for x in inputs)


def _spatial_dims(p: object, op: str) -> set[int]:
    """The dims >= 2 that ops named ``op...`` split on their first input, over the whole plan."""
    out = set()
    for name, node in p.nodes.items():  # type: ignore[attr-defined]
        if name.startswith(op):
            out |= {int(pl[2:-1]) for pl in node["in"][0] if pl.startswith("S(") and int(pl[2:-1]) >= 2}
    return out


CASES = [("unet", (4,), 1), ("unet", (2, 2), 1), ("unet", (2, 2), 2), ("volume", (4,), 1), ("volume", (2, 2), 1),
         ("volume", (2, 2), 2)]


@pytest.mark.parametrize("name,mesh,batch", CASES, ids=[f"{n}-{'x'.join(map(str, m))}-b{b}" for n, m, b in CASES])
def test_spatial_plan_trains_like_serial(name: str, mesh: tuple[int, ...], batch: int) -> None:
    model, inputs = _model(name, batch)
    plan = make_plan(model, inputs, mesh=mesh, objective="comm", baselines=False)
    conv = "conv2d" if name == "unet" else "conv3d"
    dims = _spatial_dims(plan, conv)
    assert dims, f"{name} at batch {batch} on {mesh}: no conv is split spatially"
    if mesh == (2, 2) and batch == 1:
        assert len(dims) == 2, f"{name}: batch 1 on 2x2 should split two spatial dims, got {dims}"
    serial = train_serial(model, inputs, steps=2)
    par, _ = train_parallel_threads(model, inputs, plan=plan, steps=2)
    bad = compare(serial, par, rtol=1e-7, atol=1e-9)
    assert not bad, "; ".join(bad[:5])


def test_halo_exchange_is_cheaper_than_channel_splits() -> None:
    """At batch 1 on 4 devices the planner's spatial plan moves far fewer bytes than the best plan that may
    not split space (``spatial_splits(False)``)."""
    model, inputs = volume_net(batch=1, volume=32, channels=8)
    spatial = make_plan(model, inputs, mesh=(4,), objective="comm", baselines=False)
    with spatial_splits(False):
        channels = make_plan(model, inputs, mesh=(4,), objective="comm", baselines=False)
    assert _spatial_dims(spatial, "conv3d") and not _spatial_dims(channels, "conv3d")
    assert spatial.cost["comm_bytes"] * 2 < channels.cost["comm_bytes"], (spatial.cost, channels.cost)
