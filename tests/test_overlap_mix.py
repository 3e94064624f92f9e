"""Plans mixed layer by layer between the capped overlap's two sides (``planner.mix``).

``capped_overlap``'s members are linear, so each finds a vertex of the plans' hull; the plans that balance the
gradient sync against backward compute (``o S = b K``) lie between two of them.  Mixing a stack's blocks from the
plans on either side of the dual's peak finds them: each mix is priced exactly, the bound stays the members', and
the mixed plan runs and trains as serial like any other.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from examples.models import transformer
from soybean.capture.core import capture
from soybean.cost.profiles import load_profile
from soybean.mesh import Mesh
from soybean.options import PlanOptions
from soybean.planner import solve as solve_mod
from soybean.planner.core import plan as make_plan
from soybean.planner.mix import mixes
from soybean.planner.problem import to_problem
from soybean.planner.repeats import find_repeats
from soybean.planner.solve import BACKWARD_SHARE, Search, evaluate, solve_table_on
from soybean.search import solve
from soybean.verify.testing import compare, train_parallel_threads, train_serial

# A machine on which backward compute and the gradient syncs are close on 4 devices: the members of the cap search
# end on both sides of the cap, 10% apart, and a mix of their layers beats both (found by a sweep of profiles).
BALANCED = replace(load_profile("cpu-gloo"), grad_overlap=1.0, flops=2e9, mem_bw=4e8, blocking_s=5e-3)
MESH = (4,)


def _model() -> tuple[torch.nn.Module, tuple]:
    return transformer(batch=8, seq=16, hidden=64, layers=10, heads=4)


@pytest.fixture(scope="module")
def table():  # type: ignore[no-untyped-def]
    model, inputs = _model()
    search = Search(BALANCED, PlanOptions(devices=4))
    return search.table(capture(model, inputs), Mesh(MESH)), search


def _member(g, mu: float) -> list[int]:  # type: ignore[no-untyped-def]
    p = to_problem(g, "time", overlap=(1 - mu) * g.profile.grad_overlap, compute_credit=mu * BACKWARD_SHARE)
    return solve(p, "ilp", gap=0.0, runs=find_repeats(g)).choice


@pytest.mark.unit
def test_every_mix_is_priced_as_evaluate_prices_it(table) -> None:  # type: ignore[no-untyped-def]
    """The sums that rank the mixes are ``evaluate``'s step time of each mix, the runs split at the cut, every mix
    a plan of the table, cheapest first."""
    g, _ = table
    a, b = _member(g, 0.0), _member(g, 1.0)
    assert a != b
    runs = find_repeats(g)
    (run,) = runs
    got = mixes(g, a, b, runs, BACKWARD_SHARE)
    assert len(got) == 2 * (len(run.blocks) - 1)  # every cut, both orders
    ts = [t for t, _, _ in got]
    assert ts == sorted(ts)
    layers = {v for blk in run.blocks for v in blk}
    for t, choice, parts in got:
        assert all(c in (x, y) for c, x, y in zip(choice, a, b))
        assert t == pytest.approx(evaluate(g, solve_mod.Solution(choice, 0.0, 0.0, "", 0.0, "")).step_time_s,
                                  rel=1e-12)
        assert sum(len(p.blocks) for p in parts) in (len(run.blocks), len(run.blocks) - 1, len(run.blocks) - 2)
        for p in parts:  # each part: one layout over its blocks
            assert {v for blk in p.blocks for v in blk} <= layers
            assert all(choice[blk[i]] == choice[p.blocks[0][i]] for blk in p.blocks for i in range(len(blk)))
    assert mixes(g, a, a, runs, BACKWARD_SHARE) == []


@pytest.mark.unit
def test_a_mix_beats_every_member_and_keeps_their_bound(table, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """On a table whose members end on both sides of the cap, the cap search's plan is a mix, faster than the
    best member plan, with the same bound (mixing finds plans, it proves nothing)."""
    g, search = table
    mixed = solve_table_on(g, search)
    monkeypatch.setattr(solve_mod, "_mixed_best", lambda best, found, line, budget: best)
    plain = solve_table_on(g, search)
    assert mixed.solution.solver.endswith("+mixed") and not plain.solution.solver.endswith("+mixed")
    assert mixed.solution.bound == plain.solution.bound <= mixed.step_time_s
    assert mixed.step_time_s < plain.step_time_s * 0.99
    assert mixed.solution.objective == mixed.step_time_s
    assert len(mixed.runs) == 2  # the stack tied as two runs, one from each side


@pytest.mark.sim
def test_a_mixed_plan_trains_as_serial() -> None:
    """The whole path: the planner's mixed plan (its record says so) on 4 simulated ranks, as serial."""
    model, inputs = _model()
    model = model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    p = make_plan(None, captured=capture(model, inputs), devices=4, mesh=MESH, profile=BALANCED, baselines=False)
    assert p.solver["name"].endswith("+mixed")
    assert len(p.tying["runs"]) == 2
    assert compare(train_serial(model, inputs, steps=2),
                   train_parallel_threads(model, inputs, plan=p, steps=2)[0], rtol=1e-7, atol=1e-9) == []
