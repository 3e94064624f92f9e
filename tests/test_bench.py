"""The training-step benchmark runs every variant in one spawn and reports every key."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.models import mlp  # noqa: E402
from soybean.bench import SOYBEAN_MODES, VARIANTS, BenchConfig, add_parser, cmd_bench, format_table, run_bench, spearman, tp_layout  # noqa: E402


def test_spearman_ranks_with_ties() -> None:
    assert spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert spearman([1.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(0.8660254)
    assert spearman([1.0], [2.0]) is None
    assert spearman([1.0, 1.0], [1.0, 2.0]) is None


def test_tp_layout_pairs_linears_and_leaves_an_odd_last_one() -> None:
    even, _ = mlp(batch=2, hidden=8, layers=2)
    assert tp_layout(even) == {"inp": "colwise", "hidden.0": "rowwise", "hidden.1": "colwise", "out": "rowwise"}
    odd, _ = mlp(batch=2, hidden=8, layers=1)
    assert tp_layout(odd) == {"inp": "colwise", "hidden.0": "rowwise"}


def test_add_parser_registers_bench() -> None:
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="cmd"))
    a = ap.parse_args(["bench", "examples.models:mlp", "--devices", "2", "--arg", "hidden=8", "--json"])
    assert a.fn is cmd_bench and a.devices == 2 and a.arg == ["hidden=8"] and a.json and a.steps == 12 and a.rounds == 3 and a.warmup == 3


@pytest.mark.dist
def test_bench_reports_every_variant() -> None:
    cfg = BenchConfig(model="examples.models:mlp", devices=2, args={"hidden": 32, "batch": 8}, steps=2, warmup=1, timeout_s=120)
    report = run_bench(cfg)
    for key in ("step_s", "predicted_step_s", "plans", "machine", "reasons", "spearman", "speedup_vs_serial", "speedup_vs_ddp"):
        assert key in report, key
    assert set(report["step_s"]) == set(VARIANTS)
    assert set(report["predicted_step_s"]) == set(SOYBEAN_MODES)
    for group in ("step_s", "predicted_step_s"):
        for variant, value in report[group].items():
            if value is None:
                assert report["reasons"].get(variant), f"{group}[{variant}] is null without a reason"
            else:
                assert isinstance(value, float) and value > 0, (group, variant, value)
    assert report["step_s"]["serial"] is not None and report["step_s"]["ddp"] is not None
    plan = report["plans"]["soybean"]
    assert plan["mesh"] == [2] and plan["params"]
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"]
    assert "soybean_dp" in format_table(report)
