"""One options object for planning: every field has its flag, its default and its check in one place, and every
entry point (``plan``, ``parallelize``, ``compile_backend``, the CLI's ``plan``, ``explain`` and ``draw``) takes
the same set."""
from __future__ import annotations

import dataclasses
import inspect
import re
from types import SimpleNamespace

import pytest
import torch

import soybean
from soybean import cli
from soybean.options import (
    DEFAULT_VIRTUAL_STAGES,
    FIELDS,
    FLAGS,
    KIND_FIELDS,
    MULTI_STAGE,
    PlanOptions,
    options,
    plan_kind,
    plan_options,
)

pytestmark = pytest.mark.unit


def test_every_field_has_one_flag_and_the_cli_reads_it_back() -> None:
    assert {f for f, _, _ in FLAGS} == FIELDS - {"mode", "local_batch", "inflight"}  # API-only
    parser = cli.build_parser()
    for cmd in (["plan", "m:f", "--devices", "8"], ["explain", "m:f", "--devices", "8"],
                ["draw", "m:f", "--devices", "8", "--out", "x.svg"]):
        a = parser.parse_args(cmd)
        assert plan_options(a) == PlanOptions(devices=8)  # the flags' defaults are the fields'
    a = parser.parse_args(["explain", "m:f", "--devices", "8", "--mesh", "2x4", "--objective", "comm", "--memory-gb",
                           "1.5", "--recompute", "auto", "--collectives", "ring", "--precision", "bf16-mixed",
                           "--gpus-per-node", "4", "--time-limit", "9", "--gap", "0.01", "--no-tie", "--solver", "dp",
                           "--profile", "h100-nvlink"])
    assert plan_options(a) == PlanOptions(devices=8, mesh=(2, 4), objective="comm", memory_gb=1.5, recompute="auto",
                                          collectives="ring", precision="bf16-mixed", gpus_per_node=4,
                                          time_limit_s=9.0, gap=0.01, tie_layers=False, solver="dp",
                                          profile="h100-nvlink")
    a = parser.parse_args(["plan", "m:f", "--devices", "8", "--pipeline", "2", "--microbatches", "4", "--schedule",
                           "zero-bubble", "--virtual-stages", "3"])
    assert plan_options(a) == PlanOptions(devices=8, pipeline=2, microbatches=4, schedule="zero-bubble",
                                          virtual_stages=3)
    a = parser.parse_args(["draw", "m:f", "--devices", "8", "--out", "x.svg", "--pipeline", "auto", "--placement",
                           "auto"])
    assert plan_options(a) == PlanOptions(devices=8, pipeline="auto", placement="auto")


def test_every_flag_default_is_written_once_in_plan_options() -> None:
    """No row of ``FLAGS`` carries a default of its own: each flag left out parses to its field's default, on every
    command that takes the planning flags."""
    defaults = {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    assert all("default" not in kw for _, _, kw in FLAGS)
    parser = cli.build_parser()
    for cmd in (["plan", "m:f", "--devices", "8"], ["explain", "m:f"], ["draw", "m:f", "--out", "x.svg"]):
        a = parser.parse_args(cmd)
        for field, flag, _ in FLAGS:
            want = 8 if field == "devices" and cmd[0] == "plan" else defaults[field]
            assert getattr(a, field) == want and type(getattr(a, field)) is type(want), (cmd[0], flag)
    assert {f for f, _, _ in FLAGS} >= set(KIND_FIELDS)


@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_an_interleaved_schedule_defaults_to_two_virtual_stages(schedule: str) -> None:
    assert PlanOptions(schedule=schedule).virtual == DEFAULT_VIRTUAL_STAGES == 2
    assert options(PlanOptions(), schedule=schedule).virtual == 2  # on top of defaults: no contradiction with 1
    assert PlanOptions(schedule=schedule, virtual_stages=3).virtual == 3
    assert PlanOptions(schedule="1f1b").virtual == PlanOptions().virtual == PlanOptions(virtual_stages=1).virtual == 1
    assert plan_options(cli.build_parser().parse_args(["plan", "m:f", "--devices", "4", "--pipeline", "2",
                                                       "--schedule", schedule])).virtual == 2
    with pytest.raises(ValueError, match=f"--schedule {schedule} with --virtual-stages 1: .* run 2 or more"):
        PlanOptions(schedule=schedule, virtual_stages=1)  # an explicit contradiction is still refused
    with pytest.raises(ValueError, match="--schedule gpipe with --virtual-stages 2"):
        PlanOptions(schedule="gpipe", virtual_stages=2)
    with pytest.raises(ValueError, match="--schedule gpipe with --virtual-stages 2"):
        soybean.parallelize(torch.nn.Linear(2, 2), torch.ones(2, 2), devices=1, schedule="gpipe", virtual_stages=2)


def test_fewer_microbatches_than_stages_under_1f1b_is_refused_before_any_step() -> None:
    """torch's ``Schedule1F1B`` refuses it at the first ``train_step``, after planning: here when the options are
    read.  GPipe runs one microbatch (the fix ``MicrobatchError`` names)."""
    with pytest.raises(ValueError, match="--schedule 1f1b with --pipeline 2 and --microbatches 1: .* or --schedule "
                                         "gpipe"):
        soybean.parallelize(torch.nn.Linear(2, 2), torch.ones(2, 2), devices=1, pipeline=2, microbatches=1)
    assert PlanOptions(pipeline=2, microbatches=1, schedule="gpipe").microbatches_for(2) == 1
    assert PlanOptions(pipeline=2, microbatches=2).microbatches_for(2) == 2


def test_plan_pipeline_cuts_an_interleaved_schedule_into_two_stages_per_group() -> None:
    from examples.models import transformer
    from soybean.capture.core import capture
    from soybean.parts.pipeline_plan import plan_pipeline

    model, inputs = transformer(batch=2, seq=4, hidden=8, layers=4, heads=2)
    cut, _, top = plan_pipeline(capture(model, inputs), 2, 2, 2, "interleaved-1f1b", PlanOptions(devices=2))
    assert top.pipeline is not None and top.pipeline["virtual_stages"] == 2 and len(cut) == 4
    assert [s["ranks"] for s in top.pipeline["stages"]] == [[0], [1], [0], [1]]


@pytest.mark.parametrize("pipeline,placement,kind", [
    (None, "none", "plain"), (None, "auto", "placed"), (2, "none", "pipelined"), ("auto", "none", "auto"),
    ("auto", "auto", "auto"), ("none", None, "plain"), ("3", "none", "pipelined")])
def test_one_selector_says_which_plan_to_build(pipeline: object, placement: object, kind: str) -> None:
    opts = PlanOptions(pipeline=pipeline, placement=placement)  # type: ignore[arg-type]
    assert plan_kind(opts) == kind
    assert plan_kind(opts.one_program()) == "plain" and opts.one_program().devices == opts.devices


def test_a_saved_plan_runs_as_what_it_holds() -> None:
    piped, placed, plain = (SimpleNamespace(pipeline=pipe, placement=place)
                            for pipe, place in (({"stages": []}, None), (None, {"regions": []}), (None, None)))
    for opts in (PlanOptions(), PlanOptions(pipeline="auto"), PlanOptions(placement="auto")):
        assert [plan_kind(opts, p) for p in (piped, placed, plain)] == ["pipelined", "placed", "plain"]  # type: ignore
    assert plan_kind(PlanOptions(pipeline=2), piped) == "pipelined"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pipeline=2 was given with a plan that has no pipeline stages"):
        plan_kind(PlanOptions(pipeline=2), plain)  # type: ignore[arg-type]


@pytest.mark.parametrize("change,message", [
    ({"pipeline": 1}, "--pipeline 1: use none, auto or a number of stages of at least 2"),
    ({"pipeline": "deep"}, "--pipeline 'deep': use none, auto"),
    ({"pipeline": 2, "placement": "auto"}, "--placement auto with --pipeline 2: a fixed number of stages"),
    ({"placement": "greedy"}, "unknown placement 'greedy': use one of none, auto"),
    ({"schedule": "1f2b"}, "unknown schedule '1f2b'"),
    ({"microbatches": 0}, "--microbatches must be >= 1"),
])
def test_the_kind_of_plan_is_refused_alike_by_every_front_end(change: dict, message: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    """``PlanOptions`` refuses it, and so, with the same words, ``parallelize`` (before any process group) and the
    bench's planning; the CLI's ``plan`` exits 2 naming the flag, before the model is built (it does not exist)."""
    from soybean.bench.harness import BenchConfig, make_plans

    with pytest.raises(ValueError, match=message):
        PlanOptions(**change)
    with pytest.raises(ValueError, match=message):
        soybean.parallelize(torch.nn.Linear(2, 2), torch.ones(4, 2), devices=1, **change)
    got = make_plans(BenchConfig("m:f", 2, variants=("soybean_dp",), plan_options=change), torch.nn.Linear(2, 2),
                     (torch.ones(4, 2),))
    assert isinstance(got["soybean_dp"], str) and re.search(message, got["soybean_dp"])
    argv = ["plan", "no.such.module:f", "--devices", "2"]
    for k, v in change.items():
        argv += [f"--{k}", str(v)]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # refused while parsing: argparse's choices, or --pipeline's own check
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "error" in err and f"--{next(iter(change))}" in err, err


def test_the_api_plans_the_same_combinations_as_the_cli() -> None:
    """``pipeline=`` and ``placement=`` with ``soybean.plan``: refused (it makes one program), never dropped."""
    with pytest.raises(ValueError, match="soybean.plan makes one program over every device, not pipeline=2"):
        soybean.plan(torch.nn.Linear(2, 2), (torch.ones(4, 2),), 2, pipeline=2)
    with pytest.raises(ValueError, match="not offered there"):
        soybean.compile_backend(placement="auto")


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
    from soybean.planner.core import plan

    for fn in (plan, parallelize, compile_backend):
        params = inspect.signature(fn).parameters
        assert "options" in params and any(p.kind is p.VAR_KEYWORD for p in params.values()), fn
    with pytest.raises(ValueError, match="compile_backend plans in mode replicated"):
        compile_backend(mode="dp")
