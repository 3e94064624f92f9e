"""Domain parallelism end to end: the planner splits images and volumes, and training equals serial.

A two-level U-Net (padded convs with batch norm in training mode, max-pool, transposed-conv
upsampling, skip concatenation) and a 3-D conv net (strided and dilated 3-D convs, average pooling,
nearest upsampling) at batch 1 cannot use data parallelism: the planner (objective ``comm``) splits
their spatial dims, on one axis of 4 or on both axes of 2x2 (H and W), and at batch 2 on 2x2 batch
and space (Gholami's grid).  Every rank runs as a thread; the loss, every gradient, the parameters
after SGD steps and batch norm's running statistics equal serial training's (float64, so the sums
taken in another order agree to 1e-9).

Also: the issue's full-size cases plan spatially with no fallback and >= 5x fewer bytes than the best
channel-split plan; large batches stay batch-parallel; measured activation memory per rank at batch 1
on 2 ranks is at most 0.6 of serial; batch-splitting baselines at batch 1 show as infeasible.
"""
from __future__ import annotations

import pytest
import torch

from examples.models import unet, volume_net
from soybean.planner.core import plan as make_plan
from soybean.rules.window import spatial_splits
from soybean.verify.testing import compare, train_parallel_threads, train_serial

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


def _activation_peak(model: torch.nn.Module, inputs: tuple, plan: object = None) -> int:
    """The most activation bytes live in one AdamW step (peak minus what lives before the forward): the
    serial model's, or with ``plan`` the largest of its ranks' (run as threads, each measuring itself)."""
    import copy

    from soybean.api import parallelize
    from soybean.cost.measure_memory import measure_step
    from soybean.mesh import Mesh
    from soybean.runtime.launch import run_threads

    if plan is None:
        m = measure_step(copy.deepcopy(model), inputs)
        return m.peak - m.before

    def rank_fn(rank: int, groups: list) -> int:
        m = measure_step(parallelize(model, inputs, plan=plan, rank=rank, groups=groups), inputs)
        return m.peak - m.before

    return max(run_threads(Mesh(tuple(plan.mesh)), rank_fn))  # type: ignore[attr-defined]


def test_spatial_split_halves_activation_memory() -> None:
    """Batch 1 on 2 ranks: each rank's measured activation peak is at most 0.6 of serial's.  A halo window
    an op saves for backward is kept as its halo rows only (``collectives.windowed_call``): kept whole, the
    windows held every split activation twice and the ratio was 0.70."""
    model, inputs = unet(batch=1, image=64, channels=4)
    plan = make_plan(model, inputs, mesh=(2,), objective="comm", baselines=False)
    assert _spatial_dims(plan, "conv2d")
    serial, split = _activation_peak(model, inputs), _activation_peak(model, inputs, plan)
    assert split <= 0.6 * serial, (split, serial)


def test_a_tile_changed_before_backward_is_caught() -> None:
    """The window rebuilt in backward reads the tile: modifying the tile in place in between raises."""
    from soybean.mesh import Mesh
    from soybean.runtime import run_threads, sb_halo, sb_windowed

    def rank_fn(rank: int, groups: list) -> str:
        x = torch.randn(1, 2, 4, 3, requires_grad=True)
        t = x * 1.0
        win = sb_halo(t, 0, 2, 8, ((-1, 5), (3, 9)), 0.0)
        y = sb_windowed(torch.sin, win)  # sin saves its input: the window
        with torch.no_grad():
            t.add_(1.0)
        try:
            y.sum().backward()
        except RuntimeError as e:
            return str(e)
        return "no error"

    assert all("modified in place" in r for r in run_threads(Mesh((2,)), rank_fn))


@pytest.mark.parametrize("name", ["volume_net", "unet"])
def test_full_size_batch_one_plans_split_space(name: str) -> None:
    """The issue's cases at full size, batch 1 on 4 devices, objective comm: the 3-D net on 128^3 and the
    U-Net on 1,024^2 split space in at least half of their convolutions, fall back to replicate nowhere,
    and move at least 5x fewer bytes than the best plan without spatial splits (measured: 27x and 347x)."""
    model, inputs = volume_net(batch=1, volume=128, channels=8) if name == "volume_net" else unet(
        batch=1, image=1024, channels=16)
    spatial = make_plan(model, inputs, devices=4, objective="comm", baselines=False)
    with spatial_splits(False):
        channels = make_plan(model, inputs, devices=4, objective="comm", baselines=False)
    convs = [n for n in spatial.nodes if n.startswith("conv")]
    split = [n for n in convs if any(p.startswith("S(") and int(p[2:-1]) >= 2 for p in spatial.nodes[n]["in"][0])]
    assert 2 * len(split) >= len(convs), (split, convs)
    assert not spatial.fallback_ops
    assert 5 * spatial.cost["comm_bytes"] <= channels.cost["comm_bytes"], (spatial.cost, channels.cost)


@pytest.mark.parametrize("name", ["volume_net", "unet"])
def test_large_batch_stays_batch_parallel(name: str) -> None:
    """At batch 16 on 4 devices with small images, domain splits do not win: every convolution splits the
    batch only."""
    model, inputs = volume_net(batch=16, volume=16, channels=8) if name == "volume_net" else unet(
        batch=16, image=32, channels=8)
    plan = make_plan(model, inputs, devices=4, objective="comm", baselines=False)
    convs = [n for n in plan.nodes if n.startswith("conv")]
    assert convs and all(plan.nodes[n]["in"][0] == ["S(0)"] for n in convs), {n: plan.nodes[n]["in"][0] for n in convs}


def test_data_parallel_at_batch_one_is_shown_infeasible() -> None:
    """The baselines that split the batch cannot run at batch 1 on 4 devices: the plan says so (no absurd
    figure), and the table prints the reason."""
    from soybean.report.table import table

    model, inputs = volume_net(batch=1, volume=16, channels=4)
    plan = make_plan(model, inputs, devices=4, objective="comm")
    for name in ("data_parallel", "fsdp"):
        assert "does not split over 4" in plan.baselines[name]["infeasible"], plan.baselines[name]
    assert "data_parallel    infeasible: a batch of 1" in table(plan)
