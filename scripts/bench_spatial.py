"""Domain parallelism measured on CPU: spatial plan vs channel-split plan vs serial, at batch 1.

    python scripts/bench_spatial.py                          # U-Net 512^2 and 3-D net 64^3, 2 and 4 ranks
    python scripts/bench_spatial.py --models unet --devices 2 --arg image=256 --json

For each model and rank count it plans twice with ``--objective comm`` (the planner's choice, which
splits space, and the best plan without spatial splits, ``rules.window.spatial_splits(False)``,
which splits channels), runs each plan on that many gloo processes, and measures per rank

* the peak of live activation bytes during one AdamW training step (``cost.measure_memory``: the
  peak minus what is live before the forward: parameters, optimizer states, batch, buffers), and
* the median wall time of a training step (forward, backward, AdamW step) over ``--steps`` steps,

against the serial model in this process (one thread everywhere, so each rank has the serial
run's compute).  It prints the modelled communication of each plan beside the measured figures,
and with ``--json`` the rows as JSON.  Figures from one run; the box is shared by every rank.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soybean import models  # noqa: E402
from soybean.api import parallelize  # noqa: E402
from soybean.cost.measure_memory import measure_step  # noqa: E402
from soybean.plan import Plan  # noqa: E402
from soybean.planner.core import plan as make_plan  # noqa: E402
from soybean.rules.window import spatial_splits  # noqa: E402
from soybean.runtime.launch import spawn  # noqa: E402

DEFAULTS = {"unet": {"batch": 1, "image": 512, "channels": 8},
            "volume_net": {"batch": 1, "volume": 64, "channels": 8}}


def _timed_steps(model: torch.nn.Module, inputs: tuple, steps: int) -> float:
    """Median seconds of a training step (after the steps ``measure_step`` already ran)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(model: torch.nn.Module, inputs: tuple, steps: int) -> dict[str, float]:
    mem = measure_step(model, inputs)
    return {"activation_bytes": float(mem.peak - mem.before), "step_s": _timed_steps(model, inputs, steps)}


def _rank(rank: int, world: int, ref: str, args: dict[str, Any], plan_json: str, steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model, inputs = models.load(ref, args)
    pm = parallelize(model, inputs, plan=Plan.from_dict(json.loads(plan_json)))
    return _measure(pm, inputs, steps)


def _convs_split(plan: Plan) -> str:
    convs = [n for n, v in plan.nodes.items() if n.startswith("conv")]
    spatial = [n for n in convs if any(p.startswith("S(") and int(p[2:-1]) >= 2 for p in plan.nodes[n]["in"][0])]
    return f"{len(spatial)}/{len(convs)} spatial"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="unet,volume_net")
    ap.add_argument("--devices", default="2,4")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="overrides the model sizes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        ref = f"examples.models:{name}"
        args = {**DEFAULTS.get(name, {}), **models.parse_args(a.arg)}
        model, inputs = models.load(ref, args)
        serial = _measure(copy.deepcopy(model), inputs, a.steps)
        rows.append({"model": name, "ranks": 1, "plan": "serial", "mesh": "-", "convs": "-", "comm_bytes": 0.0,
                     **serial})
        for p in (int(x) for x in a.devices.split(",")):
            spatial = make_plan(model, inputs, devices=p, objective="comm", baselines=False)
            with spatial_splits(False):
                channel = make_plan(model, inputs, devices=p, objective="comm", baselines=False)
            for label, pl in (("spatial", spatial), ("channel", channel)):
                per_rank = spawn(_rank, p, ref, args, pl.to_json(), a.steps, timeout_s=1800)
                rows.append({"model": name, "ranks": p, "plan": label, "mesh": "x".join(map(str, pl.mesh)),
                             "convs": _convs_split(pl), "comm_bytes": pl.cost["comm_bytes"],
                             "activation_bytes": max(r["activation_bytes"] for r in per_rank),
                             "step_s": max(r["step_s"] for r in per_rank)})
    if a.json:
        print(json.dumps({"rows": rows}, indent=1))
        return 0
    print(f"{'model':<11} {'ranks':>5} {'plan':<8} {'mesh':<5} {'convs':<12} {'comm MB':>9} "
          f"{'act MB/rank':>11} {'x serial':>8} {'step ms':>9} {'x serial':>8}")
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["plan"] == "serial")
        print(f"{r['model']:<11} {r['ranks']:>5} {r['plan']:<8} {r['mesh']:<5} {r['convs']:<12} "
              f"{r['comm_bytes'] / 1e6:>9.2f} {r['activation_bytes'] / 1e6:>11.1f} "
              f"{r['activation_bytes'] / base['activation_bytes']:>8.2f} {r['step_s'] * 1e3:>9.1f} "
              f"{r['step_s'] / base['step_s']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
