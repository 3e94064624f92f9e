"""scripts/bench_collectives.py: every collective x algorithm x size measured on gloo processes, its JSON rows,
the planner's pick marked once per (collective, size), predictions from the profile; the modelled table; and
``soybean plan --collectives`` forcing an algorithm into the plan JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from soybean.bench.collectives import modelled, parse_size, run, summary
from soybean.cost.collectives import choose
from soybean.cost.profiles import load_profile
from soybean.runtime import algorithms as A

KEYS = {"collective", "algorithm", "bytes", "group_size", "measured_s", "predicted_s", "chosen", "chunks"}


@pytest.mark.dist
def test_rows_cover_every_collective_and_algorithm_with_one_pick_each() -> None:
    prof = load_profile("cpu-gloo")
    rows = run(2, [4096, 1 << 20], 1, prof)
    assert all(set(r) == KEYS for r in rows)
    assert {(r["collective"], r["algorithm"]) for r in rows} == {(c, a) for c in A.COLLECTIVES for a in A.ALGORITHMS}
    for c in A.COLLECTIVES:
        for m in {r["bytes"] for r in rows if r["collective"] == c}:
            mine = [r for r in rows if (r["collective"], r["bytes"]) == (c, m)]
            assert [r["algorithm"] for r in mine if r["chosen"]] == [choose(c, m, 2, 0, prof).algorithm]
    for r in rows:
        assert r["measured_s"] > 0 and r["group_size"] == 2
        rounds, sent = A.terms(r["collective"], r["algorithm"], r["bytes"], 2, r["chunks"])
        a, b = prof.ab(0, r["collective"], r["algorithm"])
        assert r["predicted_s"] == pytest.approx(float(rounds * a + sent * b))
    s = summary(rows, min_bytes=1 << 20)
    assert s["worst_pick_over_fastest"] >= 1.0 and s["median_prediction_error"] >= 0.0


@pytest.mark.unit
def test_modelled_table_names_the_pick_for_every_group() -> None:
    text = modelled([8, 1024], [parse_size("4K"), parse_size("64M")], load_profile("h100-nvlink-ib"), inter_node=True)
    lines = text.splitlines()
    assert len(lines) == 1 + 2 * len(A.COLLECTIVES)
    assert all(any(a in line for a in A.ALGORITHMS) for line in lines[1:])
    assert parse_size("64M") == 64 << 20 and parse_size("4K") == 4096


@pytest.mark.unit
@pytest.mark.parametrize("forced", ["lp", "tree"])
def test_plan_cli_forces_an_algorithm(forced: str) -> None:
    out = subprocess.run([sys.executable, "-m", "soybean.cli", "plan", "examples.models:mlp", "--arg", "hidden=2048",
                          "--arg", "batch=8", "--devices", "4", "--mesh", "4", "--collectives", forced, "--format",
                          "json", "--quiet"], capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert plan["collectives"] == forced
    used = {r["algorithm"] for r in plan["reshards"]}
    assert forced in used and used <= {forced, "backend"}
    assert all(r["algorithm"] == "backend" for r in plan["reshards"] if r["step"].startswith("grad_all_reduce"))
    assert np.isfinite(plan["cost"]["step_time_s"])
