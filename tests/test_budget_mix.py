"""A budgeted solve of a tied stack, mixed layer by layer (``search.tying.mix_layers``).

Under a memory budget, a stack's layers laid out alike are a real restriction: one tied decision moves memory by
every layer's share at once, so the tied problem's optimum (what ``frontier`` or the joint ILP prove) can be far
above plans that lay some layers out one way and the rest the other.  The Lagrangian's two plans at its peak, one
beyond the budget and one within, mixed layer by layer, find those plans; the bound the solve reports is the
Lagrangian's, which holds for the untied problem, not the tied optimum, which does not.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from examples.models import transformer
from soybean import search
from soybean.capture.core import capture
from soybean.cost.memory import GIB, MEMORY_HEADROOM
from soybean.planner.core import plan as make_plan
from soybean.search import Problem, brute_force, solve
from soybean.search.tying import Run, alike, mix_layers
from soybean.verify.testing import compare, train_parallel_threads, train_serial

LAYERS = 6


def _stack(rng: random.Random | None = None) -> tuple[Problem, Run]:
    """``LAYERS`` equal layers in a chain, each one variable: strategy 0 fast and large, 1 slow and small (random
    ones from ``rng``), a switch between neighbours in different strategies costing a little, and a budget that
    only a mix meets well."""
    if rng is None:
        unary, memory, switch = [1.0, 2.0], [2.0, 1.0], 0.25
    else:
        k = rng.randint(2, 4)
        unary = [rng.uniform(1, 3) for _ in range(k)]
        memory = [rng.choice([1.0, 2.0, 3.0]) for _ in range(k)]
        switch = rng.uniform(0, 0.5)
    n = len(unary)
    p = Problem([np.array(unary) for _ in range(LAYERS)], memory=[np.array(memory) for _ in range(LAYERS)])
    for v in range(LAYERS - 1):
        p.add_edge(v, v + 1, switch * (1 - np.eye(n)))
    lo, hi = min(memory) * LAYERS, max(memory) * LAYERS
    p.budget = (lo + hi) / 2 if rng is None else lo + (hi - lo) * rng.uniform(0.2, 0.8)
    return p, Run("layers", 0, LAYERS - 1, tuple((v,) for v in range(LAYERS)))


@pytest.mark.unit
def test_a_mix_closes_the_gap_the_tied_optimum_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six layers, budget 9: laid out alike, every layer small (12); half of them fast and the rest small (one
    switch: 9.25) is the untied optimum.  The mix finds it, its runs split at the cut, and the untied problem's
    frontier elimination proves it.  Where that elimination is too large, the bound is the Lagrangian's 9; without
    the mix the elimination finds the plan itself; without either, the tied optimum (found exactly) is returned with
    the Lagrangian's bound, not with its own value: 12 is no bound of plans that lay layers out unlike each other."""
    p, run = _stack()
    assert brute_force(p)[1] == pytest.approx(9.25)
    got = solve(p, runs=[run])
    assert got.objective == pytest.approx(9.25) and got.solver.endswith("+mixed")
    assert p.memory_of(got.choice) <= p.budget
    assert got.bound == got.objective and got.status == "optimal"
    assert got.runs is not None and sorted(len(r.blocks) for r in got.runs) == [3, 3]
    monkeypatch.setattr(search, "UNTIED_POINTS", 0)
    mixed = solve(p, runs=[run])
    assert mixed.objective == pytest.approx(9.25) and mixed.bound == pytest.approx(9.0)
    assert mixed.status == "feasible"
    monkeypatch.undo()
    monkeypatch.setattr(search, "mix_layers", lambda *a: None)
    exact = solve(p, runs=[run])
    assert exact.objective == pytest.approx(9.25) == exact.bound and exact.solver.endswith("+untied")
    monkeypatch.setattr(search, "UNTIED_POINTS", 0)
    tied = solve(p, runs=[run])
    assert tied.objective == pytest.approx(12.0) and tied.bound == pytest.approx(9.0) and tied.runs is None


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(20))
def test_the_mix_is_the_cheapest_fitting_cut_priced_exactly(seed: int) -> None:
    """``mix_layers`` of two plans of a random stack: the cheapest plan within the budget of every cut in both
    orders (enumerated here), priced as ``Problem`` prices it; never below the untied optimum."""
    rng = random.Random(seed)
    p, run = _stack(rng)
    k = len(p.unary[0])
    a, b = [rng.randrange(k)] * LAYERS, [rng.randrange(k)] * LAYERS
    assert p.budget is not None
    cuts = [[x[v] if v < c else y[v] for v in range(LAYERS)] for c in range(1, LAYERS) for x, y in ((a, b), (b, a))]
    fitting = [p.evaluate(c) for c in cuts if p.memory_of(c) <= p.budget]
    got = mix_layers(p, a, b, [run])
    if a == b or not fitting:
        assert got is None
        return
    assert got is not None
    choice, value = got
    assert value == p.evaluate(choice) == pytest.approx(min(fitting), rel=1e-12)
    assert p.memory_of(choice) <= p.budget and value >= brute_force(p)[1] - 1e-12
    runs = alike([run], choice)
    assert sum(len(r.blocks) for r in runs) >= LAYERS - 2
    for r in runs:  # each part one layout over its blocks
        assert len({choice[blk[0]] for blk in r.blocks}) == 1


def _model() -> tuple:
    return transformer(batch=8, seq=16, hidden=64, layers=10, heads=4)


@pytest.mark.sim
def test_a_mixed_budgeted_plan_beats_the_tied_one_and_trains_as_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path: a 10-layer transformer on 4 devices under 80% of its fastest plan's memory, nothing
    recomputed.  The planner's plan mixes the layers (its record says so, the stack tied as two runs), fits, is
    proven optimal, is 7% faster than the tied optimum the frontier elimination proves (which, before, was reported
    optimal), and trains on 4 simulated ranks as serial."""
    model, inputs = _model()
    model = model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    cap = capture(model, inputs)
    kw = dict(captured=cap, devices=4, mesh=(4,), profile="cpu-gloo", baselines=False, recompute="none")
    free = make_plan(None, **kw)
    budget = 0.8 * free.cost["memory_bytes"]
    kw["memory_gb"] = budget / GIB / (1 - MEMORY_HEADROOM)
    p = make_plan(None, **kw)
    assert "+mixed" in p.solver["name"] and len(p.tying["runs"]) == 2
    assert p.cost["memory_bytes"] <= budget * (1 + 1e-9)
    monkeypatch.setattr(search, "mix_layers", lambda *a: None)
    monkeypatch.setattr(search, "UNTIED_POINTS", 0)
    tied = make_plan(None, **kw)
    assert "+mixed" not in tied.solver["name"] and tied.tying["runs"][0]["count"] == 8
    assert p.cost["step_time_s"] < tied.cost["step_time_s"] * 0.97
    # the mix proven optimal by the untied problem's frontier elimination; the tied plan's bound, the Lagrangian's,
    # below the mix (its own value would not be a bound of it)
    assert p.solver["status"] == "optimal" and p.solver["bound"] == pytest.approx(p.cost["step_time_s"], rel=1e-12)
    assert tied.solver["bound"] <= p.cost["step_time_s"]
    monkeypatch.undo()
    assert compare(train_serial(model, inputs, steps=2),
                   train_parallel_threads(model, inputs, plan=p, steps=2)[0], rtol=1e-7, atol=1e-9) == []
