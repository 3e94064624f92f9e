"""Recomputation end to end: planned (``--recompute``), priced, run by the generated program, equal to serial.

A recomputed layer (a block of a repeated stack) keeps only what leaves it; its forward, collectives
included, runs again in backward (``codegen.recompute``, non-reentrant ``torch.utils.checkpoint`` without
early stop).  Training with every layer recomputed equals serial training; every collective that runs,
the reruns included, is one the cost model priced; the modelled activations shrink and the modelled step
grows by the forward pass; ``auto`` recomputes only when nothing fits the budget without it.
"""
from __future__ import annotations

from collections import Counter

import pytest

from examples.models import resnet, transformer
from soybean.capture import capture
from soybean.codegen.lower import lower
from soybean.cost.measure_memory import measure_step
from soybean.graph import recomputable_layers
from soybean.mesh import Mesh
from soybean.planner import MemoryBudgetError
from soybean.planner import plan as make_plan
from soybean.runtime.launch import run_threads
from soybean.testing import compare, train_parallel_threads, train_serial
from tests.test_memory_model import MODELS
from tests.test_priced_is_run import priced, run_one_step

pytestmark = pytest.mark.sim

CASES = [("transformer", (2,), "mp"), ("transformer", (2,), "auto"), ("transformer", (2, 2), "auto"),
         ("gpt2", (2,), "mp"), ("llama", (2,), "dp")]
IDS = [f"{n}-{'x'.join(map(str, m))}-{d}" for n, m, d in CASES]


@pytest.mark.parametrize("name,mesh,mode", CASES, ids=IDS)
def test_recomputed_layers_train_like_serial(name: str, mesh: tuple[int, ...], mode: str) -> None:
    model, inputs = MODELS[name]()
    plan = make_plan(model, inputs, mesh=mesh, mode=mode, baselines=False, recompute="layers")
    assert plan.recompute and all(layer.split(".")[-1].isdigit() for layer in plan.recompute)
    serial = train_serial(model, inputs, steps=2)
    par, _ = train_parallel_threads(model, inputs, plan=plan, steps=2)
    bad = compare(serial, par)
    assert not bad, "; ".join(bad[:5])


@pytest.mark.parametrize("name,mesh,mode", CASES, ids=IDS)
def test_reruns_are_priced(name: str, mesh: tuple[int, ...], mode: str) -> None:
    """The program runs each recomputed layer's forward collectives twice, and the cost model priced both."""
    model, inputs = MODELS[name]()
    cap = capture(model, inputs)
    plan = make_plan(None, (), captured=cap, mesh=mesh, mode=mode, objective="comm", baselines=False,
                     recompute="layers")
    want, want_sync, comm_bytes = priced(cap, plan)
    assert comm_bytes == pytest.approx(plan.cost["comm_bytes"], rel=1e-5, abs=1e-6)
    ran = Counter(run_one_step(model, inputs, plan, cap))
    assert not Counter(want) - ran, f"priced but not run: {dict(Counter(want) - ran)}"
    extra = ran - Counter(want)
    assert all(kind == "all_reduce" for kind, _, _ in extra), f"run but not priced: {dict(extra)}"


def test_recomputation_trades_time_for_memory() -> None:
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=4, heads=4)
    none = make_plan(model, inputs, mesh=(2,), mode="mp", baselines=False)
    layers = make_plan(model, inputs, mesh=(2,), mode="mp", baselines=False, recompute="layers")
    assert none.recompute == [] and layers.recompute == [f"blocks.{i}" for i in range(4)]
    assert layers.memory["activations"] < 0.5 * none.memory["activations"]
    assert layers.cost["step_time_s"] > none.cost["step_time_s"]
    for p in (none, layers):
        split = 0 if p is none else 4
        gm = lower(capture(model, inputs), p, 0)
        assert sum(type(m).__name__ == "_Recomputed" for m in gm.children()) == split


def test_auto_recomputes_only_when_nothing_fits() -> None:
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=4, heads=4)
    cap = capture(model, inputs)
    kw = dict(captured=cap, mesh=(2,), mode="mp", baselines=False)
    least = {}
    for rec in ("none", "layers"):
        with pytest.raises(MemoryBudgetError) as e:
            make_plan(None, (), memory_gb=1e-6, recompute=rec, **kw)  # type: ignore[arg-type]
        least[rec] = e.value.least
    assert least["layers"] < least["none"]
    between = (least["layers"] + least["none"]) / 2 / 2**30
    assert make_plan(None, (), memory_gb=between, recompute="auto", **kw).recompute  # type: ignore[arg-type]
    assert not make_plan(None, (), memory_gb=10.0, recompute="auto", **kw).recompute  # type: ignore[arg-type]


def test_layers_that_update_in_place_are_not_recomputed() -> None:
    """ResNet's blocks hold batch norm (running statistics move in place): none is offered."""
    model, inputs = resnet(batch=2, image=32, width=0.125, classes=10)
    assert recomputable_layers(capture(model, inputs)) == []
    model, inputs = transformer(batch=2, seq=8, hidden=16, layers=3, heads=4)
    assert recomputable_layers(capture(model, inputs)) == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("name,mode", [("transformer", "mp"), ("gpt2", "mp"), ("llama", "dp")])
def test_measured_peak_within_10_percent_of_the_model(name: str, mode: str) -> None:
    """Two ranks as threads, every layer recomputed: the measured peak is within 10% of the modelled one.
    (A transformer under dp measures 15% above its model: not yet modelled, see the README.)"""
    from soybean.api import parallelize

    model, inputs = MODELS[name]()
    cap = capture(model, inputs)
    p = make_plan(None, (), captured=cap, devices=2, mode=mode, baselines=False, recompute="layers")

    def rank_fn(rank: int, groups: list) -> int:
        return measure_step(parallelize(model, inputs, plan=p, rank=rank, groups=groups, captured=cap), inputs).peak

    peak = max(run_threads(Mesh(tuple(p.mesh)), rank_fn))
    assert abs(p.cost["memory_bytes"] - peak) <= 0.10 * peak, (p.cost["memory_bytes"], peak)
