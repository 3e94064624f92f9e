"""Planning fails cleanly: a memory budget no plan fits names the smallest one that does (exactly), a
solver that runs out of time returns its best plan with a gap or a one-line error, and nothing but the
plan ever reaches stdout."""
from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest
import torch

from examples.models import mlp
from soybean.capture.core import capture
from soybean.cost.memory import MEMORY_HEADROOM
from soybean.planner.core import plan, relative_gap
from soybean.planner.solve import MemoryBudgetError
from soybean.search import Problem, SearchError, solve_ilp

pytestmark = pytest.mark.unit

MLP = "examples.models:mlp"


def _meta_mlp() -> tuple:
    with torch.device("meta"):
        return mlp(batch=4096, hidden=256, layers=2)


def test_the_smallest_budget_named_is_exact() -> None:
    """The error names the least memory any plan reaches over every mesh; that budget is met, with the
    plan using exactly it, and one 0.1% smaller is not."""
    m, inp = _meta_mlp()
    cap = capture(m, inp)
    with pytest.raises(MemoryBudgetError) as info:
        plan(None, (), 4, objective="comm", baselines=False, memory_gb=1e-6, captured=cap)
    least = info.value.least
    assert f"--memory-gb {least / 2**30:.4g}"[:12] in str(info.value)
    fits = plan(None, (), 4, objective="comm", baselines=False, memory_gb=least / 2**30, captured=cap)
    assert fits.cost["memory_bytes"] == pytest.approx(info.value.modelled, rel=1e-6)
    assert least == pytest.approx(info.value.modelled / (1 - MEMORY_HEADROOM))  # the model's headroom
    with pytest.raises(MemoryBudgetError):
        plan(None, (), 4, objective="comm", baselines=False, memory_gb=0.999 * least / 2**30, captured=cap)


def test_a_mesh_that_does_not_fit_is_skipped() -> None:
    """With a budget only some meshes meet, the plan comes from one of them, not an error.  Width 2 cannot
    be split 4 ways without an empty tile, but it can be split 2 ways on each axis of 2x2, so only 2x2
    reaches the smaller footprint."""
    with torch.device("meta"):
        m, inp = mlp(batch=8, hidden=2, layers=2, in_features=2, out_features=2)
    cap = capture(m, inp)
    leasts = {}
    for mesh in ((4,), (2, 2)):
        with pytest.raises(MemoryBudgetError) as info:
            plan(None, (), 4, mesh=mesh, objective="comm", baselines=False, memory_gb=1e-12, captured=cap)
        leasts[mesh] = info.value.least
    assert leasts[(2, 2)] < leasts[(4,)]
    budget = (leasts[(2, 2)] + leasts[(4,)]) / 2 / 2**30
    p = plan(None, (), 4, objective="comm", baselines=False, memory_gb=budget, captured=cap)
    assert p.mesh == [2, 2] and [mm["mesh"] for mm in p.meshes] == [[2, 2]]


def _random_problem(n: int, k: int, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    p = Problem([rng.random(k) for _ in range(n)])
    for v in range(1, n):
        for u in (v - 1, int(rng.integers(0, v))):
            if u != v:
                p.add_edge(u, v, rng.random((k, k)))
    return p


def test_time_limit_gives_the_best_plan_with_its_bound_or_a_clean_error() -> None:
    """Whatever a 1 ms limit lets HiGHS do, the answer is honest: optimal with no gap, the best plan
    found with a bound below it, or a ``SearchError`` that names ``--time-limit``."""
    p = _random_problem(60, 6, 0)
    try:
        sol = solve_ilp(p, time_limit_s=0.001)
    except SearchError as e:
        assert "--time-limit" in str(e)
        return
    assert sol.status in ("optimal", "feasible")
    assert sol.objective == pytest.approx(p.evaluate(sol.choice))
    assert sol.bound <= sol.objective + 1e-9
    if sol.status == "optimal":
        assert relative_gap(sol.objective, sol.bound) < 1e-6


def test_relative_gap() -> None:
    assert relative_gap(2.0, 1.5) == 0.25
    assert relative_gap(2.0, 2.0) == 0.0 and relative_gap(0.0, 0.0) == 0.0
    assert relative_gap(1.0, 1.0 + 1e-12) == 0.0  # a bound past the objective is rounding, not a gap


def test_solver_output_never_reaches_stdout() -> None:
    """HiGHS prints its banner on file descriptor 1 even with output suppressed; the ILP discards
    it, so a JSON plan on stdout stays valid and ``--quiet`` stays quiet."""
    code = ("from soybean.search import solve_ilp, Problem; import numpy as np; "
            "p = Problem([np.array([1.0, 2.0]), np.array([2.0, 1.0])]); "
            "p.add_edge(0, 1, np.array([[0.0, 3.0], [3.0, 0.0]])); solve_ilp(p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and "HiGHS" not in out.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "soybean.cli", "plan", MLP, *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_budget_no_plan_fits_is_one_line_and_exit_2() -> None:
    out = _cli("--devices", "2", "--arg", "hidden=64", "--memory-gb", "1e-6", "--format", "json")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--memory-gb" in lines[0] and "Traceback" not in out.stderr


def test_cli_plan_json_reports_the_gap_and_rejects_a_bad_time_limit() -> None:
    out = _cli("--devices", "2", "--arg", "hidden=64", "--format", "json", "--time-limit", "30")
    assert out.returncode == 0, out.stderr
    solver = json.loads(out.stdout)["solver"]
    assert solver["status"] == "optimal" and solver["gap"] == 0.0
    bad = _cli("--devices", "2", "--time-limit", "0")
    assert bad.returncode == 2 and "--time-limit" in bad.stderr


def test_a_baseline_that_cannot_run_is_marked_not_priced() -> None:
    """Data parallelism cannot split a batch of 6 over 4 devices without an empty tile: the baseline is
    marked infeasible with the reason, in the JSON and the table, never priced at the 1e30 penalty."""
    from soybean.report.table import table

    m, inp = mlp(batch=6, hidden=10, layers=1)
    p = plan(m, inp, 4, objective="comm")
    assert set(p.baselines["data_parallel"]) == {"infeasible"}
    assert "batch" in p.baselines["data_parallel"]["infeasible"]
    assert p.baselines["model_parallel"]["comm_bytes"] < 1e20
    d = json.loads(p.to_json())
    assert d["baselines"]["data_parallel"] == p.baselines["data_parallel"]
    assert any(line.startswith("data_parallel") and "infeasible" in line for line in table(p).splitlines())


def test_a_mesh_whose_solve_finds_no_plan_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """One mesh's solve running out of time does not sink the plan: the other meshes' best is kept; only
    when every mesh fails does the error surface."""
    from soybean.planner import core as planner

    with torch.device("meta"):
        m, inp = mlp(batch=8, hidden=8, layers=1)
    cap = capture(m, inp)
    real = planner.solve_on

    def flaky(cap, mesh, *a, **k):
        if mesh.ndim == 2:
            raise SearchError("the ILP solver found no plan within 1 s: give more time (--time-limit)")
        return real(cap, mesh, *a, **k)

    monkeypatch.setattr(planner, "solve_on", flaky)
    p = plan(None, (), 4, objective="comm", baselines=False, captured=cap)
    assert p.mesh == [4] and [mm["mesh"] for mm in p.meshes] == [[4]]
    with pytest.raises(SearchError, match="no plan within 1 s"):
        plan(None, (), 4, mesh=(2, 2), objective="comm", baselines=False, captured=cap)


def test_a_pruned_mesh_is_reported_with_its_bound(tmp_path) -> None:
    """A mesh left unsolved because its lower bound could not win shows that bound, in the JSON (rounded like
    every figure) and in the table, never as an optimum."""
    from soybean.plan import Plan
    from soybean.report.table import table

    src = Path(__file__).parent / "golden" / "transformer-8-objective=time.json"
    p = Plan.load(src)
    p.meshes = [m for m in p.meshes if m["mesh"] != [2, 2, 2]] + [
        {"mesh": [2, 2, 2], "bound": 0.0123456789, "pruned": True}]
    out = tmp_path / "p.json"
    out.write_text(p.to_json())
    again = json.loads(out.read_text())["meshes"]
    assert again[-1] == {"mesh": [2, 2, 2], "bound": 0.0123457, "pruned": True}
    assert "2x2x2>=0.01235 (bound, not solved)" in table(Plan.load(out))


def test_a_forced_layout_that_needs_a_forbidden_resharding_says_so() -> None:
    """``mode="dp"`` with a batch of 5 on 4 devices leaves one device no rows: every plan of the forced layout
    carries the pinned penalty (a step of 3e30 s was returned without a word); one warning names it and the fix.
    A batch of 7 (uneven, every device some rows) plans without it."""
    import warnings

    model, (x, _) = mlp(batch=5, hidden=8, layers=1)
    with pytest.warns(UserWarning, match="mode 'dp' on mesh 4: the forced layout cannot run this model as it is"):
        plan(model, (x,), 4, mesh=(4,), mode="dp", baselines=False)
    model, (x, _) = mlp(batch=7, hidden=8, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan(model, (x,), 4, mesh=(4,), mode="dp", baselines=False).cost["step_time_s"] < 1


def test_the_solver_line_says_when_a_plan_is_not_proven_near_optimal() -> None:
    """A search stopped at its time limit with no bound, or a plan further than 1% from its bound, is said on the
    solver line: the printed plan may not be the fastest."""
    from soybean.report.table import _unproven

    assert "time limit" in _unproven({"bound": float("-inf"), "gap": float("inf"), "status": "feasible"})
    assert _unproven({"bound": 0.371, "gap": 0.0219, "status": "feasible"}) == \
        ": gap 2.19%, a plan up to that much faster may exist"
    assert _unproven({"bound": 1.0, "gap": 1e-5, "status": "optimal"}) == ""


def test_a_plan_over_the_devices_memory_without_a_budget_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    """No ``--memory-gb``, and the plan's modelled peak is over the profile's device memory: one warning line on
    stderr naming the option; with a budget given, none."""
    from soybean.cli import main

    args = ["plan", "hf:llama", "--arg", "meta=True", "--arg", "num_hidden_layers=1", "--arg", "hidden_size=256",
            "--arg", "num_attention_heads=4", "--arg", "num_key_value_heads=2", "--arg", "intermediate_size=512",
            "--arg", "vocab_size=32000", "--arg", "batch=64", "--arg", "seq=8192", "--devices", "2",
            "--profile", "cpu-gloo", "--quiet", "--no-cache"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "is over cpu-gloo's 12 GiB: give --memory-gb 12 to plan within it" in err
    assert main(args + ["--memory-gb", "10000"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_cutoff_prunes_every_mesh_that_cannot_beat_it() -> None:
    """``plan(..., cutoff=)`` prunes as another mesh's plan would: above the best plan's step the same plan comes
    back; below it every mesh is pruned (its bound at least the cutoff: proven) and ``Outclassed`` carries the
    baselines, priced all the same."""
    from soybean.planner.core import Outclassed

    model, inputs = mlp(batch=16, hidden=64, layers=4)
    cap = capture(model, inputs)
    kw = dict(captured=cap, profile="h100-nvlink")
    best = plan(None, (), 4, baselines=False, **kw)
    again = plan(None, (), 4, baselines=False, cutoff=2 * best.cost["step_time_s"], **kw)
    assert again.cost["step_time_s"] == best.cost["step_time_s"] and again.mesh == best.mesh
    cut = 0.5 * best.cost["step_time_s"]
    with pytest.raises(Outclassed) as e:
        plan(None, (), 4, baselines=True, cutoff=cut, **kw)
    assert e.value.bound >= cut and {"data_parallel", "fsdp"} <= set(e.value.baselines)
