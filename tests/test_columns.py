"""The LP relaxation by column generation (``search.columns``) against the whole LP: same optimum, a bound
that is always proven, cutoffs, hints, and the ILP's answers unchanged."""
from __future__ import annotations

import random

import numpy as np
import pytest

from soybean.search import Problem, brute_force, columns, solve_ilp
from soybean.search.columns import Hints, lagrangian_bound, solve_by_columns
from soybean.search.formulation import formulate
from soybean.search.highs import solve_formulation

pytestmark = pytest.mark.unit


def dense_problem(rng: random.Random, n: int, width: int, budget: bool = False) -> Problem:
    """A loopy graph (each variable joined to its two predecessors) of wide variables: the core shape column
    generation is for, with LP optima that are often fractional."""
    unary = [np.array([rng.random() for _ in range(rng.randint(width // 2, width))]) for _ in range(n)]
    p = Problem(unary)
    for v in range(1, n):
        for u in {v - 1, max(0, v - 2)} - {v}:
            p.add_edge(u, v, np.array([[rng.random() * 3 for _ in unary[v]] for _ in unary[u]]))
    if budget:
        p.memory = [np.array([rng.random() for _ in u]) for u in unary]
        p.budget = sum(float(np.median(m)) for m in p.memory)
    return p


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [False, True])
def test_columns_reach_the_whole_lps_optimum_with_a_proven_bound(seed: int, budget: bool) -> None:
    rng = random.Random(seed)
    p = dense_problem(rng, rng.randint(4, 9), 12, budget)
    f = formulate(p)
    status, _, whole = solve_formulation(f, False, 60.0, 0.0)
    assert status == "optimal"
    out = solve_by_columns(p, f, 60.0, 0.0)
    assert out is not None
    status, values, bound = out
    assert status == "optimal" and values is not None
    assert bound <= whole + 1e-9                       # proven: never above the LP optimum
    assert bound == pytest.approx(whole, rel=1e-7, abs=1e-9)
    # the restricted LP's point is a point of the whole LP: rows met, costs as the whole LP prices it
    ax = f.matrix() @ values
    assert np.all(ax >= f.row_lo - 1e-7) and np.all(ax <= f.row_hi + 1e-7)
    assert float(f.cost @ values) + f.offset == pytest.approx(whole, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_the_lagrangian_bound_holds_for_any_multipliers(seed: int) -> None:
    """``L(pi) <= LP optimum`` for every ``pi`` (``pi <= 0`` on the memory row): random multipliers, and
    the optimal ones recover it."""
    rng = random.Random(40 + seed)
    p = dense_problem(rng, 6, 8, budget=bool(seed % 2))
    f = formulate(p)
    _, _, whole = solve_formulation(f, False, 60.0, 0.0)
    A = f.matrix()
    nprng = np.random.default_rng(seed)
    le = np.isneginf(f.row_lo)
    for _ in range(20):
        pi = nprng.normal(scale=2.0, size=f.num_row)
        pi[le] = -np.abs(pi[le])
        assert lagrangian_bound(f, pi, f.cost - A.T @ pi) <= whole + 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_a_cutoff_below_the_optimum_prunes_with_a_proven_bound(seed: int) -> None:
    rng = random.Random(80 + seed)
    p = dense_problem(rng, 7, 12)
    f = formulate(p)
    _, _, whole = solve_formulation(f, False, 60.0, 0.0)
    out = solve_by_columns(p, f, 60.0, 0.0, cutoff=whole * 0.999)
    assert out is not None and out[0] == "cutoff"
    assert whole * 0.999 <= out[2] <= whole + 1e-9
    # a cutoff above the optimum does not prune
    assert solve_by_columns(p, f, 60.0, 0.0, cutoff=whole * 1.001)[0] == "optimal"  # type: ignore[index]


def test_a_hint_from_the_last_solve_of_that_shape_is_used_and_changes_nothing() -> None:
    """A second problem of the same shape with other costs (the next ``capped_overlap`` member) starts from
    the first one's columns and plan and reaches its own optimum."""
    rng = random.Random(7)
    p = dense_problem(rng, 8, 12)
    q = Problem([u * 1.1 for u in p.unary], {k: C * 0.9 for k, C in p.edges.items()})
    hints = Hints()
    solve_by_columns(p, formulate(p), 60.0, 0.0, hints=hints)
    assert len(hints) == 1 and hints.get(q) is not None  # the same shape
    fq = formulate(q)
    out = solve_by_columns(q, fq, 60.0, 0.0, hints=hints)
    _, _, whole = solve_formulation(fq, False, 60.0, 0.0)
    assert out is not None and out[2] == pytest.approx(whole, rel=1e-7)
    assert len(hints) == 1
    other = Hints()  # a caller's own hints: another run's solves leave none in them
    cold = solve_by_columns(q, fq, 60.0, 0.0, hints=other)
    assert cold is not None and cold[2] == pytest.approx(whole, rel=1e-7) and len(other) == 1


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("budget", [False, True])
def test_the_ilp_by_columns_equals_brute_force(seed: int, budget: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columns, "COLUMNS_MIN", 1)
    rng = random.Random(200 + seed)
    p = dense_problem(rng, rng.randint(3, 5), 5, budget)
    choice, best = brute_force(p)
    sol = solve_ilp(p, gap=0.0)
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert sol.bound <= best + 1e-9
    if budget:
        assert p.memory_of(sol.choice) <= p.budget + 1e-9  # type: ignore[operator]


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_is_a_point_of_its_formulation_and_starts_branch_and_bound(seed: int) -> None:
    """``Formulation.values_of`` (what the ILP hands HiGHS as its first incumbent): a plan's vector meets every row,
    costs what the problem prices the plan at, and reads back as the plan; the ILP started from any plan still
    ends at the optimum (brute force)."""
    rng = random.Random(seed)
    p = dense_problem(rng, rng.randint(4, 7), 6)
    f = formulate(p)
    for _ in range(5):
        choice = [rng.randrange(len(u)) for u in p.unary]
        x = f.values_of(choice)
        ax = f.matrix() @ x
        assert np.all(ax >= f.row_lo - 1e-9) and np.all(ax <= f.row_hi + 1e-9)
        assert float(f.cost @ x) + f.offset == pytest.approx(p.evaluate(choice), rel=1e-9)
        assert f.choice(x) == choice
        status, values, _ = solve_formulation(f, True, 60.0, 0.0, start=choice)
        assert status == "optimal" and values is not None
        assert p.evaluate(f.choice(values)) == pytest.approx(brute_force(p)[1], rel=1e-9)
