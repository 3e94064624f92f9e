"""``soybean diff``: nothing for a plan and itself (or its saved copy), every differing tiling and cost term
otherwise; exit 0 when the same, 1 when they differ, as ``diff``."""
from __future__ import annotations

import copy

import pytest
import torch

from examples.models import transformer
from soybean.capture.core import capture
from soybean.cli import main
from soybean.plan import Plan
from soybean.report.plandiff import diff
from soybean.planner.core import plan

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def plans() -> tuple[Plan, Plan]:
    """The data-parallel plan and the optimum of a small transformer block on 4 devices in a row: the optimum
    splits weights (tensor parallel), data parallelism replicates them all."""
    with torch.device("meta"):
        model, inputs = transformer(batch=8, seq=256, hidden=1024, layers=1, heads=16)
    cap = capture(model, inputs)
    dp = plan(None, captured=cap, devices=4, mesh=(4,), objective="comm", mode="dp", baselines=False)
    best = plan(None, captured=cap, devices=4, mesh=(4,), objective="comm", baselines=False)
    return dp, best


def test_a_plan_and_its_saved_copy_are_the_same(plans: tuple[Plan, Plan], tmp_path) -> None:
    dp, best = plans
    assert diff(best, best) == []
    best.save(tmp_path / "p.json")
    assert diff(best, Plan.load(tmp_path / "p.json")) == []  # floats rounded on save still compare equal
    again = copy.deepcopy(best)
    again.solver["seconds"] += 5.0  # run-to-run records are not compared
    assert diff(best, again) == []


def test_dp_against_the_optimum_lists_each_differing_parameter(plans: tuple[Plan, Plan]) -> None:
    dp, best = plans
    lines = diff(dp, best)
    differ = {fqn for fqn in dp.params if dp.params[fqn] != best.params[fqn]}
    assert differ  # the optimum splits some weight data parallelism replicates
    assert {ln.split(":")[0].removeprefix("param ") for ln in lines if ln.startswith("param ")} == differ
    for fqn in differ:
        assert f"param {fqn}: {','.join(dp.params[fqn])} -> {','.join(best.params[fqn])}" in lines
    assert all(dp.params[f] == ["R"] for f in differ)
    assert any(ln.startswith("node ") for ln in lines)
    assert any(ln.startswith("cost comm_bytes: ") for ln in lines)
    assert lines[-1].startswith(f"{len(differ)} of {len(dp.params)} parameters, ")


def test_setting_and_names_in_one_plan_only(plans: tuple[Plan, Plan]) -> None:
    _, best = plans
    other = copy.deepcopy(best)
    other.profile, other.mesh = "h100-nvlink", [2, 2]
    name = next(iter(other.nodes))
    del other.nodes[name]
    lines = diff(best, other)
    assert "mesh: 4 -> 2x2" in lines and "profile: cpu-gloo -> h100-nvlink" in lines
    assert any(ln.startswith(f"node {name}: ") and ln.endswith(" -> (absent)") for ln in lines)


def test_cli_exit_codes_and_empty_output_when_same(plans: tuple[Plan, Plan], tmp_path, capsys) -> None:
    dp, best = plans
    a, b = tmp_path / "dp.json", tmp_path / "best.json"
    dp.save(a)
    best.save(b)
    assert main(["diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out == ""
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines() == diff(Plan.load(a), Plan.load(b))
    assert main(["diff", str(a), str(tmp_path / "missing.json")]) == 2
    assert "cannot read plan" in capsys.readouterr().err


def test_diff_lists_the_collective_algorithms_that_differ() -> None:
    from examples.models import mlp
    from soybean.planner.core import plan

    model, inputs = mlp(batch=8, hidden=2048, layers=2)
    auto = plan(model, inputs, 4, mesh=(4,), baselines=False)
    forced = plan(model, inputs, 4, mesh=(4,), baselines=False, collectives="lp")
    lines = diff(auto, forced)
    assert "collectives: auto -> lp" in lines
    changed = [line for line in lines if line.startswith("collective all_reduce[axis 0")]
    assert changed and all(line.endswith("-> lp") for line in changed)
    assert diff(forced, forced) == []


def test_a_variant_alone_is_a_difference(plans: tuple[Plan, Plan]) -> None:
    """Two plans whose op differs only in its strategy variant (the same tilings run another way: causal attention's
    zig-zag rows) differ, and the line names the variant."""
    _, best = plans
    other = copy.deepcopy(best)
    name = next(iter(other.nodes))
    other.nodes[name]["variant"] = "zigzag"
    lines = [ln for ln in diff(best, other) if ln.startswith(f"node {name}: ")]
    assert len(lines) == 1 and lines[0].endswith(" zigzag)")
