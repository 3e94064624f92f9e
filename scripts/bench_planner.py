"""Planner speed: capture, enumerate+cost, search and total seconds for GPT-2-small-shaped transformers.

    python scripts/bench_planner.py                 # 12 and 48 layers, 8 devices, every mesh shape
    python scripts/bench_planner.py --layers 12 --devices 8 --json
    python scripts/bench_planner.py --layers 12 --profile cpu-gloo   # tests/test_plan.py's GPT-2-small case

The phases (capture, enumerate+cost, search) are timed apart, one ILP per mesh; ``plan s`` is the
whole ``planner.plan`` call as a user makes it (capture, every mesh with the planner's own search
options, no baselines), the call whose speed the tests do not assert.  It runs after the phases,
so with whatever they left cached in the process.

Weights live on the meta device: planning never allocates them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.models import transformer
from soybean.capture import capture
from soybean.cost.profiles import load_profile
from soybean.graph import build
from soybean.mesh import factorizations
from soybean.planner import plan
from soybean.search import solve, to_problem


def bench(layers: int, devices: int, objective: str, profile: str) -> dict:
    with torch.device("meta"):
        model, inputs = transformer(batch=8, seq=1024, hidden=768, layers=layers, heads=12)
    t0 = time.perf_counter()
    cap = capture(model, inputs)
    t_cap = time.perf_counter() - t0
    prof = load_profile(profile)
    t_build = t_search = 0.0
    statuses = {}
    for mesh in factorizations(devices):
        t = time.perf_counter()
        g = build(cap, mesh, prof, objective=objective)
        p = to_problem(g, objective)
        t_build += time.perf_counter() - t
        t = time.perf_counter()
        statuses[str(mesh)] = solve(p, "ilp").status
        t_search += time.perf_counter() - t
    t = time.perf_counter()
    whole = plan(model, inputs, devices, objective=objective, profile=profile, baselines=False)
    t_plan = time.perf_counter() - t
    return {"layers": layers, "nodes": len(cap.graph.nodes), "capture_s": round(t_cap, 3),
            "enumerate_cost_s": round(t_build, 3), "search_s": round(t_search, 3),
            "total_s": round(t_cap + t_build + t_search, 3), "plan_s": round(t_plan, 3),
            "plan_mesh": whole.mesh, "status": statuses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="*", default=[12, 48])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--objective", default="time")
    ap.add_argument("--profile", default="h100-nvlink")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [bench(n, a.devices, a.objective, a.profile) for n in a.layers]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'layers':>6} {'fx nodes':>8} {'capture s':>10} {'enum+cost s':>12} {'search s':>9} {'total s':>8}"
          f" {'plan s':>7} {'plan mesh':>9}  status")
    for r in rows:
        print(f"{r['layers']:>6} {r['nodes']:>8} {r['capture_s']:>10.2f} {r['enumerate_cost_s']:>12.2f}"
              f" {r['search_s']:>9.2f} {r['total_s']:>8.2f} {r['plan_s']:>7.2f} {'x'.join(map(str, r['plan_mesh'])):>9}"
              f"  {r['status']}")


if __name__ == "__main__":
    main()
