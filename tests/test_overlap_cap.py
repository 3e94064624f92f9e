"""The capped gradient-sync overlap, searched exactly: ``planner.capped_overlap``.

A plan's step is ``T(x) = L(x) - min(o S(x), b K(x))`` (``planner.evaluate``).  The search solves linear members
``T_mu = L - (1 - mu) o S - mu b K`` (each below ``T`` everywhere): every member's optimum is a lower bound of the
best plan, the reported bound is one of them, and the plan found is never worse than member 0's or the plan with
nothing credited (the two the planner solved before).  Recomputation then only adds time, so under a budget
that the fastest plain plan meets, nothing is recomputed; and the two-pass mesh search (``planner._plan``) finds
the best plan over meshes that each mesh searched alone finds.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from examples.models import transformer
from soybean.capture.core import capture
from soybean.cost.memory import MEMORY_HEADROOM
from soybean.cost.profiles import load_profile
from soybean.graph import PlanGraph
from soybean.mesh import Mesh
from soybean.options import PlanOptions
from soybean.planner.core import Pruned, plan as make_plan
from soybean.planner.solve import BACKWARD_SHARE, MU_MET, MemoryBudgetError, Result, Search, capped_overlap, evaluate, solve_table_on
from soybean.planner.recompute import solve_recompute
from soybean.planner.problem import to_problem
from soybean.search import Solution, solve

pytestmark = pytest.mark.unit

# A machine on which backward is short beside the gradient syncs: crediting every sync as hidden (member 0)
# picks a plan whose credit the cap then takes back.
SLOW = replace(load_profile("cpu-gloo"), grad_overlap=1.0, flops=1.1e9, mem_bw=2e8, blocking_s=5e-3)


@pytest.fixture(scope="module")
def table():  # type: ignore[no-untyped-def]
    model, inputs = transformer(batch=4, seq=16, hidden=32, layers=2, heads=4)
    search = Search(SLOW, PlanOptions(devices=2))
    return search.table(capture(model, inputs), Mesh((2,))), search


def _member(g, mu: float):  # type: ignore[no-untyped-def]
    p = to_problem(g, "time", overlap=(1 - mu) * g.profile.grad_overlap, compute_credit=mu * BACKWARD_SHARE)
    s = solve(p, "ilp", gap=0.0)
    return evaluate(g, s), s.bound


def test_the_bound_is_below_every_plan_and_the_plan_beats_the_old_two(table) -> None:  # type: ignore[no-untyped-def]
    g, search = table
    r = solve_table_on(g, search)
    first, _ = _member(g, 0.0)
    assert g.profile.grad_overlap * first.sync_s > first.cap_s  # member 0 over-credits: the case under test
    none = evaluate(g, solve(to_problem(g, "time", overlap=0.0), "ilp", gap=0.0))
    assert r.solution.objective == r.step_time_s
    assert r.step_time_s <= min(first.step_time_s, none.step_time_s) * (1 + 1e-12)
    assert r.step_time_s < first.step_time_s  # the credit the cap took back was worth a different plan
    for mu in (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0):
        plan, dual = _member(g, mu)
        assert dual <= r.step_time_s * (1 + 1e-9)            # weak duality: every member is below T
        assert r.solution.bound <= plan.step_time_s * (1 + 1e-9)  # the bound is below every plan found
    assert r.solution.bound >= _member(g, 0.0)[1] * (1 - 1e-9)  # never weaker than member 0's


def test_a_cutoff_above_the_plan_keeps_it_and_one_below_the_bound_prunes(table) -> None:  # type: ignore[no-untyped-def]
    g, search = table
    r = solve_table_on(g, search)
    assert solve_table_on(g, search, incumbent=r.step_time_s * 1.5).step_time_s == pytest.approx(r.step_time_s)
    with pytest.raises(Pruned):
        solve_table_on(g, search, incumbent=r.solution.bound * 0.5)


def test_the_mesh_search_equals_each_mesh_searched_alone() -> None:
    """Under a budget with recomputation free, ``plan``'s two passes (plain plans first, the rest cheapest bound
    first) find the plan each mesh's own ``solve_recompute`` finds at its best."""
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=4, heads=4)
    cap = capture(model, inputs)
    top = make_plan(None, (), captured=cap, devices=4, baselines=False).cost["memory_bytes"]
    for share in (1.0, 0.8):  # 0.8: three blocks of four recomputed (each mesh alone: ~15 s of budgeted ILPs)
        budget = share * top
        p = make_plan(None, (), captured=cap, devices=4, memory_gb=budget / (1 - MEMORY_HEADROOM) / 2**30,
                      recompute="auto", baselines=False)
        best = float("inf")
        for m in ((4,), (2, 2)):
            try:
                r = solve_recompute(cap, Mesh(m), Search(load_profile(None), PlanOptions(devices=4),
                                                         memory_bytes=budget))
            except MemoryBudgetError:
                continue
            best = min(best, r.step_time_s)
        assert p.cost["step_time_s"] == pytest.approx(best, rel=1e-6), share
        if share == 1.0:
            assert p.recompute == []  # the fastest plan fits: recomputation would only add time


def test_a_member_met_again_up_to_rounding_is_not_solved_again() -> None:
    """The cap search's members, replayed from a Llama-3-8B mesh (8x4x2): two plans with nearly equal lines make
    the next crossing land within rounding of the member before it, which would solve the same problem again."""
    cap, o = 0.1, 1.0
    g = PlanGraph(Mesh((2,)), replace(load_profile("cpu-gloo"), grad_overlap=o))
    lines = [(0.31402, 0.0499), (0.42230847, -0.06279276), (0.38792931, -0.02818713), (0.32215331, 0.04102435),
             (0.38792931 - 0.955e-6, -0.02818713 + 1e-6)]  # the last: below the one before only near mu 0.95

    def plan(i: int, mu: float) -> Result:  # a plan whose line T_mu = a + mu * slope is lines[i]
        a, slope = lines[i]
        sync = (slope + cap) / o
        value = a + mu * slope
        return Result(g, Solution([i], value, value, "optimal", 0.0, "test"), 0.0, a + o * sync, 0.0, 0.0,
                      min(o * sync, cap), sync, cap_s=cap)

    mus: list[float] = []
    seen = [plan(0, 0.0)]

    def solved(mu: float, cut: float | None, enough: float) -> Result:
        assert enough == pytest.approx(min(r.step_time_s for r in seen) * (1 - 1e-4))  # the bound that would do
        mus.append(mu)
        seen.append(plan(min(range(len(lines)), key=lambda j: lines[j][0] + mu * lines[j][1]), mu))
        return seen[-1]

    best = capped_overlap(seen[0], solved, gap=1e-4)
    assert len(mus) == 4  # 1, then three crossings; the fourth crossing is the third again, up to 1e-7
    assert all(abs(x - y) > MU_MET for i, x in enumerate(mus) for y in mus[:i])
    assert best.step_time_s == pytest.approx(min(plan(i, 0.0).step_time_s for i in range(len(lines))))
    assert best.solution.bound <= best.step_time_s


def test_a_hint_starts_the_cap_search_nearer_its_peak() -> None:
    """``hint``: another mesh's peak tried before member 1.  The dual's lines as above: started at the peak the
    search ends in fewer members with the same plan, and its bound is as good; started where the dual still rises
    (the first plan is best there again), member 1 follows, and the search reaches the same plan."""
    cap, o = 0.1, 1.0
    g = PlanGraph(Mesh((2,)), replace(load_profile("cpu-gloo"), grad_overlap=o))
    lines = [(0.31402, 0.0499), (0.42230847, -0.06279276), (0.38792931, -0.02818713), (0.32215331, 0.04102435)]

    def plan(i: int, mu: float) -> Result:
        a, slope = lines[i]
        sync = (slope + cap) / o
        value = a + mu * slope
        return Result(g, Solution([i], value, value, "optimal", 0.0, "test"), 0.0, a + o * sync, 0.0, 0.0,
                      min(o * sync, cap), sync, cap_s=cap)

    def search(hint: float | None) -> tuple[Result, list[float]]:
        mus: list[float] = []

        def solved(mu: float, cut: float | None, enough: float) -> Result:
            mus.append(mu)
            return plan(min(range(len(lines)), key=lambda j: lines[j][0] + mu * lines[j][1]), mu)

        return capped_overlap(plan(0, 0.0), solved, gap=1e-4, hint=hint), mus

    cold, cold_mus = search(None)
    assert cold.peak_mu is not None and cold.peak_mu in cold_mus
    warm, warm_mus = search(cold.peak_mu)
    assert warm_mus[0] == cold.peak_mu and len(warm_mus) < len(cold_mus)
    assert warm.solution.choice == cold.solution.choice and warm.solution.bound >= cold.solution.bound - 1e-12
    rising, rising_mus = search(0.01)
    assert rising_mus[:2] == [0.01, 1.0] and rising.solution.choice == cold.solution.choice
