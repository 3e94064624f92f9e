"""Memory budget sweep: soybean's plan against the practitioners' memory baselines, modelled.

    python scripts/bench_memory.py                       # GPT-2 small, batch 8 x 1,024, 4 devices, cpu-gloo
    python scripts/bench_memory.py --model "hf:gpt2 n_layer=4" --devices 2 --points 5 --json

The model is captured once (on the meta device: nothing is allocated).  The sweep runs from the budget
at which everything fits (the peak of the best plan without a budget, plus ``MEMORY_HEADROOM``) down to the
smallest any plan reaches (every layer recomputed, the least-memory tilings), in ``--points`` equal steps.
At each budget it plans with ``--recompute auto`` (recomputation decided with the tilings, ``planner.solve_recompute``)
and prints soybean's modelled step time, mesh and recomputed layer count beside the baselines priced
under the same cost model and budget (``soybean.planner.baselines``): FSDP, FSDP with every layer recomputed,
FSDP with each layer's attention recomputed (selective), and data parallelism.  ``x best baseline`` is the
best feasible baseline's step time over soybean's (above 1: soybean faster).  All figures are modelled
(``--profile``, default ``cpu-gloo``); with ``--json`` the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soybean import models  # noqa: E402
from soybean.capture.core import capture  # noqa: E402
from soybean.cost.memory import MEMORY_HEADROOM  # noqa: E402
from soybean.planner.core import plan  # noqa: E402
from soybean.planner.solve import MemoryBudgetError

BASELINES = ("fsdp", "fsdp_recompute", "fsdp_selective_recompute", "data_parallel")


def sweep(ref: str, devices: int, points: int, profile: str | None) -> list[dict[str, Any]]:
    name, *pairs = ref.split()  # a model reference with --arg pairs: "hf:gpt2 n_layer=4"
    kw = models.parse_args(pairs)
    kw.setdefault("meta", True)
    model, inputs = models.load(name, kw)
    cap = capture(model, inputs)
    free = plan(None, (), devices, captured=cap, profile=profile, baselines=False)
    try:
        plan(None, (), devices, captured=cap, profile=profile, baselines=False, recompute="layers", memory_gb=1e-6)
        raise AssertionError("a budget of 1 KB fits")
    except MemoryBudgetError as e:
        least = e.least
    top = free.cost["memory_bytes"] / (1 - MEMORY_HEADROOM)  # the --memory-gb at which the unbudgeted plan fits
    rows = []
    for i in range(points):
        budget = (top - (top - least) * i / max(1, points - 1)) * (1 + 1e-9) / 2**30
        t0 = time.perf_counter()
        p = plan(None, (), devices, captured=cap, profile=profile, memory_gb=budget, recompute="auto")
        row: dict[str, Any] = {"budget_gb": budget, "step_time_s": p.cost["step_time_s"], "mesh": p.mesh,
                               "memory_gb": p.cost["memory_bytes"] / 2**30, "recomputed": len(p.recompute),
                               "plan_s": time.perf_counter() - t0}
        feasible = []
        for b in BASELINES:
            rec = p.baselines.get(b, {})
            row[b] = rec.get("step_time_s")
            if row[b] is not None:
                feasible.append(row[b])
        row["best_baseline_ratio"] = min(feasible) / p.cost["step_time_s"] if feasible else None
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["budget GB", "soybean s", "mesh", "recomputed", *BASELINES, "x best baseline"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [f"{r['budget_gb']:.3f}", f"{r['step_time_s']:.3f}", "x".join(map(str, r["mesh"])),
                 str(r["recomputed"])]
        cells += [f"{r[b]:.3f}" if r[b] is not None else "over budget" for b in BASELINES]
        cells.append(f"{r['best_baseline_ratio']:.3f}" if r["best_baseline_ratio"] else "-")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf:gpt2 batch=8 seq=1024")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = sweep(a.model, a.devices, a.points, a.profile)
    print(json.dumps({"rows": rows}, indent=1) if a.json else _table(rows))


if __name__ == "__main__":
    main()
