"""The plan JSON of every example model is byte-identical to the recorded one.

A refactor must not change a plan: the files under ``tests/golden/`` were written by the code
before the change and are compared byte by byte.  The one wall-clock field, ``solver.seconds``,
is zeroed on both sides.  After an intended change of plans, regenerate them with
``python tests/test_golden_plans.py`` and say why in the commit.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from examples.models import alexnet, mlp, resnet, transformer, vgg16

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden"
MODELS = {
    "mlp": lambda: mlp(batch=8, hidden=12, layers=2),
    "mlp_uneven": lambda: mlp(batch=6, hidden=10, layers=1),
    "mlp_cls": lambda: mlp(batch=4, hidden=16, layers=0, classes=5),
    "alexnet": lambda: alexnet(batch=4, image=32, width=0.0625, classes=10),
    "vgg16": lambda: vgg16(batch=2, image=32, width=0.0625, classes=10),
    "resnet18": lambda: resnet(batch=2, image=32, classes=10, depth=18, width=0.125),
    "transformer": lambda: transformer(batch=4, seq=8, hidden=16, layers=2, heads=4),
    "transformer_lm": lambda: transformer(batch=2, seq=8, hidden=16, layers=2, heads=4, vocab=50),
}
# (model, devices, options): every example, both objectives, both built-in profiles, forced baselines
# and the local-batch contract.
CASES: list[tuple[str, int, dict[str, Any]]] = [
    (name, 4, {"objective": obj}) for name in MODELS for obj in ("time", "comm")
] + [
    ("transformer", 8, {"objective": "time"}),
    ("transformer_lm", 8, {"objective": "comm", "profile": "h100-nvlink"}),
    ("mlp", 4, {"objective": "time", "profile": "h100-nvlink"}),
    ("mlp", 4, {"objective": "time", "local_batch": True}),
    ("mlp", 2, {"objective": "comm", "mode": "mp"}),
    ("alexnet", 2, {"objective": "time", "mode": "dp"}),
]


def case_id(name: str, devices: int, opts: dict[str, Any]) -> str:
    return "-".join([name, str(devices)] + [f"{k}={v}" for k, v in sorted(opts.items())])


def plan_json(name: str, devices: int, opts: dict[str, Any]) -> str:
    from soybean.planner.core import plan

    model, inputs = MODELS[name]()
    p = plan(model, inputs, devices, **opts)
    d = json.loads(p.to_json())
    d["solver"]["seconds"] = 0.0
    return json.dumps(d, indent=1, sort_keys=True) + "\n"


@pytest.mark.parametrize("name,devices,opts", CASES, ids=[case_id(*c) for c in CASES])
def test_plan_json_is_unchanged(name: str, devices: int, opts: dict[str, Any]) -> None:
    want = (GOLDEN / f"{case_id(name, devices, opts)}.json").read_text()
    assert plan_json(name, devices, opts) == want


if __name__ == "__main__":  # regenerate the recorded plans
    import warnings

    warnings.simplefilter("ignore")
    GOLDEN.mkdir(exist_ok=True)
    for c in CASES:
        (GOLDEN / f"{case_id(*c)}.json").write_text(plan_json(*c))
        print("wrote", case_id(*c))
