"""The budgeted search by elimination over (time, memory) frontiers (``search.frontier``), against enumeration."""
from __future__ import annotations

import random

import numpy as np
import pytest

from soybean import search
from soybean.search import Problem, Pruned, brute_force, solve
from soybean.search.budget import lagrangian
from soybean.search.frontier import TooLarge, schedule, solve_frontier

pytestmark = pytest.mark.unit


def series_parallel(rng: random.Random, n: int) -> Problem:
    """A random graph of treewidth at most 2 (each new variable joined to one variable, or to both ends of an
    edge already there), a few strategies each, memory per strategy and a budget that binds."""
    unary = [np.array([rng.random() * 5 for _ in range(rng.randint(2, 5))]) for _ in range(n)]
    p = Problem(unary)

    def pair(u: int, v: int) -> None:
        p.add_edge(u, v, np.array([[rng.random() * 4 for _ in unary[v]] for _ in unary[u]]))

    for v in range(1, n):
        if p.edges and rng.random() < 0.5:
            a, b = rng.choice(sorted(p.edges))
            pair(a, v)
            pair(b, v)
        else:
            pair(rng.randrange(v), v)
    # Few memory values per variable, as split or whole tensors give.
    p.memory = [np.array([rng.choice([1.0, 2.0, 4.0]) * (1 + v % 3) for _ in u]) for v, u in enumerate(unary)]
    lo, hi = sum(float(m.min()) for m in p.memory), sum(float(m.max()) for m in p.memory)
    p.budget = lo + (hi - lo) * rng.uniform(0.2, 0.6)
    return p


def optimum(p: Problem) -> float | None:
    try:
        return brute_force(p)[1]
    except ValueError:
        return None  # nothing fits


@pytest.mark.parametrize("seed", range(40))
def test_the_frontier_elimination_equals_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    p = series_parallel(rng, rng.randint(2, 9))
    opt = optimum(p)
    choice = solve_frontier(p)
    if opt is None:
        assert choice is None
        return
    assert choice is not None and p.memory_of(choice) <= p.budget * (1 + 1e-9)
    assert p.evaluate(choice) == pytest.approx(opt, rel=1e-12)
    # Below an upper bound at the optimum there is nothing; just above it, the optimum; whatever the multiplier the
    # pruning prices memory at.
    for lam in (0.0, 0.3, 5.0):
        assert solve_frontier(p, upper=opt, multiplier=lam) is None
        found = solve_frontier(p, upper=opt * (1 + 1e-6) + 1e-9, multiplier=lam)
        assert found is not None and p.evaluate(found) == pytest.approx(opt, rel=1e-12)


def test_parts_not_joined_and_a_budget_nothing_meets() -> None:
    rng = random.Random(5)
    a, b = series_parallel(rng, 4), series_parallel(rng, 3)
    p = Problem(a.unary + b.unary, dict(a.edges), a.memory + b.memory, a.budget + b.budget)
    for (u, v), C in b.edges.items():
        p.add_edge(u + a.n, v + a.n, C)
    choice = solve_frontier(p)
    assert choice is not None and p.evaluate(choice) == pytest.approx(brute_force(p)[1], rel=1e-12)
    p.budget = sum(float(m.min()) for m in p.memory) * 0.99
    assert solve_frontier(p) is None


def test_a_graph_too_wide_is_refused_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five variables all joined: eliminating any joins a table of 2^5 entries, past a ``MAX_TABLE`` of 16."""
    from soybean.search import frontier

    monkeypatch.setattr(frontier, "MAX_TABLE", 16)
    rng = random.Random(2)
    p = Problem([np.array([rng.random(), rng.random()]) for _ in range(5)])
    for u in range(5):
        for v in range(u + 1, 5):
            p.add_edge(u, v, np.array([[rng.random(), rng.random()], [rng.random(), rng.random()]]))
    p.memory, p.budget = [np.array([1.0, 2.0]) for _ in range(5)], 7.0
    with pytest.raises(TooLarge):
        schedule(p)
    with pytest.raises(TooLarge):
        solve_frontier(p)
    assert solve(p, "ilp").objective == pytest.approx(brute_force(p)[1], rel=1e-9)  # the joint ILP instead


@pytest.mark.parametrize("seed", range(12))
def test_solve_closes_the_duality_gap_without_the_joint_ilp(seed: int) -> None:
    """With the joint ILP's refinement off (``REFINE_MAX`` 0), ``solve`` still returns the budgeted optimum proven
    (bound equal to objective): the frontier elimination closes what the Lagrangian leaves; and under a cutoff
    at the optimum it is pruned with a true bound or returns the optimum."""
    rng = random.Random(700 + seed)
    p = series_parallel(rng, rng.randint(4, 9))
    opt = optimum(p)
    if opt is None:
        return
    dual = lagrangian(p, lambda q, cut: search._solve_free(q, "ilp", 10.0, 0.0), float("inf"))
    saved = search.REFINE_MAX
    search.REFINE_MAX = 0
    try:
        sol = solve(p, "ilp", gap=0.0)
        try:
            cut = solve(p, "ilp", gap=0.0, cutoff=opt).objective
        except Pruned as e:
            cut = None
            assert e.bound <= opt + 1e-9
    finally:
        search.REFINE_MAX = saved
    assert sol.objective == pytest.approx(opt, rel=1e-12) and sol.bound == pytest.approx(opt, rel=1e-12)
    assert sol.status == "optimal" and p.memory_of(sol.choice) <= p.budget * (1 + 1e-9)
    assert cut is None or cut == pytest.approx(opt, rel=1e-12)
    assert dual.bound <= opt + 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_random_directed_graphs_equal_enumeration(seed: int) -> None:
    """Graphs not built series-parallel (each variable joined to one or two earlier ones at random): exact, or
    refused as too wide."""
    from tests.test_search import random_problem

    p = random_problem(random.Random(900 + seed), 7, True, budget=True)
    try:
        choice = solve_frontier(p)
    except TooLarge:
        return
    assert choice is not None and p.evaluate(choice) == pytest.approx(brute_force(p)[1], rel=1e-12)


def test_a_transformer_table_under_a_binding_budget_equals_the_joint_ilp() -> None:
    """A one-layer transformer's table on a 2x2 mesh under a budget 30% of the way from the least memory any plan
    needs to what its fastest plan needs: the frontier elimination's plan is the joint ILP's optimum (HiGHS at gap 0
    on costs scaled to about 1: unscaled, HiGHS returned a plan 0.04% dearer as optimal), where the Lagrangian
    alone leaves a duality gap."""
    from examples.models import transformer
    from soybean.capture.core import capture
    from soybean.cost.profiles import BUILTIN
    from soybean.graph import build
    from soybean.mesh import Mesh
    from soybean.planner.problem import to_problem
    from soybean.search.ilp import solve_ilp

    model, inputs = transformer(batch=8, seq=16, hidden=32, layers=1, heads=4)
    g = build(capture(model, inputs), Mesh((2, 2)), BUILTIN["h100-nvlink"], objective="time")
    free = to_problem(g, "time")
    fastest = search._solve_free(free, "ilp", 30.0, 0.0).choice
    p = to_problem(g, "time", memory_budget=1.0)
    assert p.memory is not None
    least = sum(float(m.min()) for m in p.memory)
    p.budget = least + 0.3 * (p.memory_of(fastest) - least)
    dual = lagrangian(p, lambda q, cut: search._solve_free(q, "ilp", 30.0, 0.0), float("inf"))
    assert dual.solution is not None
    upper = dual.solution.objective
    choice = solve_frontier(p, upper, dual.multiplier)  # None: nothing fits below the Lagrangian's plan
    assert choice is None or p.memory_of(choice) <= p.budget * (1 + 1e-9)
    found = upper if choice is None else p.evaluate(choice)
    joint = solve_ilp(p, time_limit_s=300.0, gap=0.0)
    assert joint.status == "optimal"
    assert found == pytest.approx(joint.objective, rel=1e-9)
    assert dual.bound < joint.objective * (1 - 1e-3)  # a duality gap the Lagrangian alone leaves open
