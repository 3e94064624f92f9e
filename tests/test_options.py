"""One options object for planning: every field has its flag, its default and its check in one place, and every
entry point (``plan``, ``parallelize``, ``compile_backend``, the CLI's ``plan``, ``explain`` and ``draw``) takes
the same set."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

import soybean
from soybean import cli
from soybean.options import FIELDS, FLAGS, PlanOptions, options, plan_options

pytestmark = pytest.mark.unit


def test_every_field_has_one_flag_and_the_cli_reads_it_back() -> None:
    assert {f for f, _, _ in FLAGS} == FIELDS - {"mode", "local_batch"}  # API-only: the CLI plans the optimum
    parser = cli.build_parser()
    for cmd in (["plan", "m:f", "--devices", "8"], ["explain", "m:f", "--devices", "8"],
                ["draw", "m:f", "--devices", "8", "--out", "x.svg"]):
        a = parser.parse_args(cmd)
        assert plan_options(a) == PlanOptions(devices=8, precision="fp32")  # the flags' defaults are the fields'
    a = parser.parse_args(["explain", "m:f", "--devices", "8", "--mesh", "2x4", "--objective", "comm", "--memory-gb",
                           "1.5", "--recompute", "auto", "--collectives", "ring", "--precision", "bf16-mixed",
                           "--gpus-per-node", "4", "--time-limit", "9", "--gap", "0.01", "--no-tie", "--solver", "dp",
                           "--profile", "h100-nvlink"])
    assert plan_options(a) == PlanOptions(devices=8, mesh=(2, 4), objective="comm", memory_gb=1.5, recompute="auto",
                                          collectives="ring", precision="bf16-mixed", gpus_per_node=4,
                                          time_limit_s=9.0, gap=0.01, tie_layers=False, solver="dp",
                                          profile="h100-nvlink")


@pytest.mark.parametrize("change,message", [
    ({"devices": 0}, "--devices must be >= 1, got 0"),
    ({"devices": 6, "mesh": "2x4"}, r"mesh 2x4 \(--mesh\) has 8 devices, not 6 \(--devices\)"),
    ({"objective": "speed"}, "unknown objective 'speed': use one of comm, time"),
    ({"solver": "greedy"}, "unknown solver 'greedy'"),
    ({"mode": "pp"}, "unknown mode 'pp': use one of auto, dp, mp, replicated"),
    ({"recompute": "all"}, "unknown recompute 'all'"),
    ({"collectives": "star"}, "unknown collectives 'star'"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"gap": 1.0}, r"--gap must be in \[0, 1\)"),
    ({"time_limit_s": 0}, "--time-limit must be positive"),
    ({"gpus_per_node": 0}, "--gpus-per-node must be >= 1"),
    ({"memory_gb": -1.0}, "--memory-gb must be positive GiB"),
])
def test_a_bad_option_is_named(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlanOptions(**change)
    with pytest.raises(ValueError, match=message):  # the same check, whichever entry point
        soybean.plan(None, (), **change)


def test_keywords_on_top_of_options() -> None:
    base = PlanOptions(objective="comm", memory_gb=4.0)
    assert options(base, mesh=[2, 2]) == dataclasses.replace(base, mesh=(2, 2))
    assert options(base, objective=None).objective == "comm"  # None leaves a field as it is
    assert options(base, objective="time").objective == "time"
    assert PlanOptions(mesh="2x2").world == 4 and PlanOptions().world == 1 and PlanOptions(devices=3).world == 3
    with pytest.raises(TypeError, match="unknown planning option 'objectiv'"):
        options(base, objectiv="time")
    with pytest.raises(TypeError, match="unknown planning option 'objectiv'"):
        soybean.plan(None, (), objectiv="time")


def test_entry_points_take_the_options_object() -> None:
    from soybean.api import parallelize
    from soybean.compile import compile_backend
    from soybean.planner import plan

    for fn in (plan, parallelize, compile_backend):
        params = inspect.signature(fn).parameters
        assert "options" in params and any(p.kind is p.VAR_KEYWORD for p in params.values()), fn
    with pytest.raises(ValueError, match="compile_backend plans in mode replicated"):
        compile_backend(mode="dp")
