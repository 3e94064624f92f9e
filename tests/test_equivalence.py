"""Serial equivalence (sim tier): every rank as a thread; loss, grads and params after 3 AdamW steps equal serial."""
from __future__ import annotations

import pytest
import torch

from examples.models import alexnet, mlp, transformer
from soybean.verify import compare, train_parallel_threads, train_serial

MODELS = {
    "mlp": lambda: mlp(batch=8, hidden=12, layers=1),
    "mlp_uneven": lambda: mlp(batch=6, hidden=10, layers=1),
    "transformer": lambda: transformer(batch=4, seq=8, hidden=16, layers=2, heads=4),
    "alexnet": lambda: alexnet(batch=4, image=32, width=0.0625, classes=10),
}
CASES = [
    ("mlp", (2,), "dp"), ("mlp", (2,), "mp"), ("mlp", (2,), "auto"),
    ("mlp", (4,), "mp"), ("mlp", (2, 2), "dp"), ("mlp", (2, 2), "mp"),
    ("mlp_uneven", (4,), "mp"), ("mlp", (1,), "auto"),
    ("transformer", (2,), "mp"), ("transformer", (2,), "dp"), ("transformer", (2, 2), "mp"),
    ("alexnet", (2,), "mp"),
]


@pytest.mark.parametrize("name,mesh,mode", CASES, ids=[f"{n}-{'x'.join(map(str, m))}-{md}" for n, m, md in CASES])
def test_parallel_training_equals_serial(name: str, mesh: tuple, mode: str) -> None:
    model, inputs = MODELS[name]()
    serial = train_serial(model, inputs)
    par, plan = train_parallel_threads(model, inputs, mesh=mesh, mode=mode, objective="comm")
    bad = compare(serial, par)
    assert not bad, f"plan {plan.params}: " + "; ".join(bad[:5])


def test_plan_roundtrips_through_json(tmp_path) -> None:
    from soybean.plan import Plan

    model, inputs = MODELS["mlp"]()
    _, plan = train_parallel_threads(model, inputs, mesh=(2,), mode="mp", steps=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    a, _ = train_parallel_threads(model, inputs, plan=Plan.load(path), steps=2)
    b, _ = train_parallel_threads(model, inputs, plan=plan, steps=2)
    assert a.losses == b.losses


def test_wrong_world_size_and_wrong_model_are_clear_errors() -> None:
    from soybean.api import check_plan
    from soybean.capture import capture
    from soybean.planner import plan as make_plan

    model, inputs = MODELS["mlp"]()
    p = make_plan(model, inputs, 2, baselines=False)
    cap = capture(model, inputs)
    with pytest.raises(ValueError, match="world size is 4"):
        check_plan(p, cap.fingerprint, 4)
    other, oin = mlp(batch=8, hidden=14, layers=1)
    with pytest.raises(ValueError, match="another model"):
        check_plan(p, capture(other, oin).fingerprint, 2)
