"""Exact search equals exhaustive enumeration; SoyBean's DP and k-cuts against the ILP."""
from __future__ import annotations

import itertools
from dataclasses import replace
import random

import numpy as np
import pytest
import torch
from torch import nn

from soybean.capture.core import capture
from soybean.graph import build
from soybean.mesh import Mesh, factorizations
from soybean.cost.profiles import BUILTIN
from soybean.planner.kcuts import kcuts
from soybean.planner.problem import to_problem
from soybean.search import Problem, brute_force, reduce, solve, solve_dp, solve_ilp

pytestmark = pytest.mark.unit

PROFILE = BUILTIN["cpu-gloo"]


# ---- abstract problems --------------------------------------------------------------------


def random_problem(rng: random.Random, n: int, dag: bool, budget: bool = False) -> Problem:
    unary = [np.array([rng.random() * 5 for _ in range(rng.randint(2, 5))]) for _ in range(n)]
    p = Problem(unary)
    for v in range(1, n):
        parents = {v - 1} if not dag else set(rng.sample(range(v), k=min(v, rng.randint(1, 2))))
        for u in parents:
            p.add_edge(u, v, np.array([[rng.random() * 10 for _ in unary[v]] for _ in unary[u]]))
    if budget:
        p.memory = [np.array([rng.random() for _ in u]) for u in unary]
        p.budget = sum(float(m.mean()) for m in p.memory)
    return p


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dag", [False, True])
def test_solvers_equal_brute_force_on_random_problems(seed: int, dag: bool) -> None:
    rng = random.Random(seed)
    p = random_problem(rng, rng.randint(2, 8), dag)
    _, best = brute_force(p)
    assert solve(p, "ilp").objective == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert solve(p, "dp").objective == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert solve_ilp(p).objective == pytest.approx(best, rel=1e-9, abs=1e-9)  # without reductions
    assert solve_dp(p).objective == pytest.approx(best, rel=1e-9, abs=1e-9)


def classed_problem(rng: random.Random, n: int) -> Problem:
    """Edges priced by classes of strategies (as a reshard prices tilings, not strategies): repeated
    rows and columns, some edges separable (``f(s) + g(t)``), some constant."""
    unary = [np.array([rng.random() * 5 for _ in range(rng.randint(2, 6))]) for _ in range(n)]
    p = Problem(unary)
    for v in range(1, n):
        for u in {v - 1} | ({rng.randrange(v)} if v > 1 else set()):
            a, b = len(unary[u]), len(unary[v])
            rc, cc = [rng.randrange(2) for _ in range(a)], [rng.randrange(3) for _ in range(b)]
            kind = rng.choice(["classes", "separable", "constant"])
            if kind == "classes":
                K = np.array([[rng.random() * 10 for _ in range(3)] for _ in range(2)])
                C = K[np.ix_(rc, cc)]
            elif kind == "separable":
                C = np.array([[rng.random() for _ in range(b)]]) + np.array([[rng.random()] for _ in range(a)])
            else:
                C = np.full((a, b), 2.5)
            p.add_edge(u, v, C)
    return p


@pytest.mark.parametrize("seed", range(10))
def test_ilp_merges_strategy_classes_exactly(seed: int) -> None:
    """Equal rows/columns share pair variables and separable edges need none: fewer columns, same
    optimum as enumeration, LP and all."""
    from soybean.search.formulation import formulate
    rng = random.Random(300 + seed)
    p = classed_problem(rng, rng.randint(3, 7))
    _, best = brute_force(p)
    assert solve_ilp(p, gap=0.0).objective == pytest.approx(best, rel=1e-9, abs=1e-9)
    pairs = sum(C.size for C in p.edges.values() if min(C.shape) > 1)
    f = formulate(p)
    assert f.num_col - f.x_start[-1] < pairs or pairs == 0


@pytest.mark.parametrize("seed", range(6))
def test_ilp_memory_budget_equals_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    p = random_problem(rng, 6, True, budget=True)
    choice, best = brute_force(p)
    sol = solve(p, "ilp")
    assert sol.objective == pytest.approx(best, rel=1e-9)
    assert p.memory_of(sol.choice) <= p.budget + 1e-9


def test_reductions_leave_a_small_core_for_chains() -> None:
    p = random_problem(random.Random(1), 8, dag=False)
    assert reduce(p).core.n <= 1


# ---- real graphs: random small models ------------------------------------------------------


class RandomNet(nn.Module):
    """A random DAG of at most 8 ops over (batch, width) activations."""

    def __init__(self, seed: int, width: int = 6, n_ops: int = 4) -> None:
        super().__init__()
        rng = random.Random(seed)
        self.plan: list[tuple[str, int, int]] = []
        self.lins = nn.ModuleList()
        for i in range(n_ops):
            kind = rng.choice(["linear", "linear", "relu", "add"]) if i else "linear"
            a = rng.randrange(i + 1)
            b = rng.randrange(i + 1)
            if kind == "linear":
                self.lins.append(nn.Linear(width, width, bias=rng.random() < 0.5))
            self.plan.append((kind, a, b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vals = [x]
        li = 0
        for kind, a, b in self.plan:
            if kind == "linear":
                vals.append(self.lins[li](vals[a]))
                li += 1
            elif kind == "relu":
                vals.append(torch.relu(vals[a]))
            else:
                vals.append(vals[a] + vals[b])
        return vals[-1].sum()


def small_problem(seed: int, mesh: Mesh, objective: str):
    torch.manual_seed(seed)
    net = RandomNet(seed, n_ops=2 if mesh.ndim > 1 else 4)
    cap = capture(net, (torch.randn(4, 6),))
    g = build(cap, mesh, PROFILE, objective=objective)
    return cap, g, to_problem(g, objective)


CASES = [(p, m) for p in (2, 4) for m in factorizations(p)]


@pytest.mark.parametrize("devices,mesh", CASES, ids=[f"P{p}-{m}" for p, m in CASES])
@pytest.mark.parametrize("seed", range(3))
def test_ilp_equals_enumeration_on_model_graphs(devices: int, mesh: Mesh, seed: int) -> None:
    for objective in ("comm", "time"):
        _, g, p = small_problem(seed, mesh, objective)
        ops = sum(v.kind == "op" for v in g.vars)
        assert ops <= 8
        _, best = brute_force(p, limit=100_000_000)
        assert solve(p, "ilp").objective == pytest.approx(best, rel=1e-7)
        if devices == 2:  # SoyBean's one-cut DP
            assert solve(p, "dp").objective == pytest.approx(best, rel=1e-7)


EQUAL = [("batch-heavy", 2), ("batch-heavy", 3), ("weight-heavy", 2), ("mixed", 2)]


@pytest.mark.parametrize("blocking_s", [0.0, PROFILE.blocking_s])
def test_kcuts_versus_joint_ilp(blocking_s: float) -> None:
    """Recursive k-cuts against the joint optimum on the same (2,2) and (2,2,2) meshes.

    SoyBean's argument (one cut at a time is optimal) holds when the best cut of
    the halved problem is the same choice again, so that every cut repeats the
    first: then the greedy sequence is the joint optimum.  Measured with the
    time tie-break of ``blocking_s = 0``: gap 0 for the batch-heavy MLP at k=2
    and k=3 and for the weight-heavy and mixed MLPs at k=2.  (For the
    batch-heavy MLP, one cut rates "replicate the weight and all-reduce its
    gradient" and "store it split, all-gather forward, reduce-scatter backward"
    at the same bytes; the tie is broken towards split storage by its smaller
    optimizer step, and the later cuts extend that into the hierarchical layout
    the joint ILP also finds.)  The CPU profile's ``blocking_s`` prices the
    split storage's two blocking collectives above the replica's asynchronous
    all-reduce, so the tie breaks the other way, and the greedy plan then sends
    2.2% (k=2) and 4.7% (k=3) more bytes than the joint optimum: the argument's
    premise fails, as the test shows.

    At k=3 the weight-heavy and mixed MLPs show a 37.5% gap: the first two cuts
    are each optimal alone (Megatron column/row splits), but they leave the
    third cut only choices that reshard between the layers, whereas the joint
    optimum spends the three axes together (one of them on the batch from the
    start).  The test prints every gap, asserts equality where the argument
    holds, and that the measured gaps are never negative.
    """
    profile = replace(PROFILE, blocking_s=blocking_s)
    torch.manual_seed(0)
    gaps = {}
    for name, (batch, hidden) in {"batch-heavy": (512, 8), "weight-heavy": (2, 64), "mixed": (32, 32)}.items():
        net = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        cap = capture(net, (torch.randn(batch, hidden),))
        for k in (2, 3):
            g, greedy = kcuts(cap, k, profile, "comm")
            joint = solve(to_problem(build(cap, Mesh((2,) * k), profile, objective="comm"), "comm"), "ilp")
            assert greedy.objective >= joint.objective - 1e-6 * max(1.0, joint.objective)
            gaps[(name, k)] = (greedy.objective - joint.objective) / max(joint.objective, 1e-12)
    print("k-cuts gap over joint ILP:", {f"{n} k={k}": round(v, 4) for (n, k), v in gaps.items()})
    for name, k in EQUAL:
        if blocking_s and name == "batch-heavy":  # the tie broken towards the replica: the premise fails
            assert 0.0 < gaps[(name, k)] < 0.06, (name, k)
        else:
            assert gaps[(name, k)] == pytest.approx(0.0, abs=1e-9), (name, k)
    assert gaps[("weight-heavy", 3)] > 0.0 and gaps[("mixed", 3)] > 0.0


# ---- the LP-first ILP, its backends, and the budget's Lagrangian certificate --------------------


def frustrated_triangle() -> Problem:
    """Three variables that each want to differ from both neighbours (2 strategies each): the LP
    relaxation's optimum is the fractional x = 1/2 everywhere, cheaper than any plan."""
    p = Problem([np.zeros(2) for _ in range(3)])
    for u, v in ((0, 1), (1, 2), (0, 2)):
        p.add_edge(u, v, np.array([[1.0, 0.0], [0.0, 1.0]]))
    return p


def test_fractional_lp_goes_on_to_branch_and_bound() -> None:
    p = frustrated_triangle()
    _, best = brute_force(p)
    sol = solve_ilp(p, gap=0.0)
    assert sol.objective == pytest.approx(best) == 1.0
    assert sol.status == "optimal" and sol.bound == pytest.approx(1.0)


def test_a_bound_the_caller_cannot_use_skips_branch_and_bound() -> None:
    """``enough`` above the rounded LP plan (all 0: cost 3): branch and bound could lift the bound to 3 at most,
    short of what the caller needs, so the plan comes back with the LP's bound (0)."""
    p = frustrated_triangle()
    sol = solve_ilp(p, gap=0.0, enough=3.5)
    assert sol.objective == pytest.approx(3.0) and sol.bound == pytest.approx(0.0) and sol.status == "feasible"
    sol = solve(p, "ilp", gap=0.0, enough=2.0)  # a bound of 2 may be proven: branch and bound runs, to the optimum
    assert sol.objective == pytest.approx(1.0) == sol.bound and sol.status == "optimal"


@pytest.mark.parametrize("seed", range(8))
def test_budget_lagrangian_certificate_holds(seed: int) -> None:
    """The Lagrangian alone (before the frontier elimination or the joint ILP close its gap): its plan fits, and
    its bound is a true lower bound of the budgeted optimum: bound <= OPT <= objective."""
    from soybean.search import _solve_free
    from soybean.search.budget import lagrangian

    rng = random.Random(400 + seed)
    p = random_problem(rng, 7, True, budget=True)
    _, opt = brute_force(p)
    dual = lagrangian(p, lambda q, cut: _solve_free(q, "ilp", 10.0, 0.0), float("inf"))
    assert dual.solution is not None
    sol = replace(dual.solution, bound=dual.bound)
    assert p.memory_of(sol.choice) <= p.budget + 1e-9
    assert sol.bound <= opt + 1e-9 <= sol.objective + 2e-9
    if sol.status == "optimal":
        assert sol.objective == pytest.approx(opt, rel=1e-6)


def test_budget_that_the_free_optimum_meets_is_solved_without_multipliers() -> None:
    rng = random.Random(7)
    p = random_problem(rng, 6, True, budget=True)
    p.budget = float(sum(m.max() for m in p.memory))  # every plan fits
    sol = solve(p, "ilp")
    assert sol.status == "optimal" and "lagrangian" not in sol.solver
    assert sol.objective == pytest.approx(brute_force(p)[1], rel=1e-9)


def test_budget_relaxed_solve_out_of_time_keeps_the_best_so_far() -> None:
    """A relaxed solve that runs out of time (``SearchError``) ends the bisection: the fitting plan and the
    bound found before it stand, a certificate still (bound <= OPT <= objective)."""
    from soybean.search import _solve_free
    from soybean.search.budget import lagrangian
    from soybean.search.ilp import SearchError

    rng = random.Random(11)
    for _ in range(20):
        p = random_problem(rng, 7, True, budget=True)
        if p.memory_of(brute_force(replace(p, budget=None, memory=None))[0]) > p.budget:
            break  # the free optimum does not fit: the bisection needs several solves
    _, opt = brute_force(p)
    full = lagrangian(p, lambda q, cut: _solve_free(q, "ilp", 10.0, 0.0), float("inf"))
    assert full.solves >= 3 and full.solution is not None
    calls = []

    def flaky(q: Problem, cut: float | None):
        calls.append(q)
        if len(calls) == full.solves:  # the last solve of the full run fails instead
            raise SearchError("out of time")
        return _solve_free(q, "ilp", 10.0, 0.0)

    cut = lagrangian(p, flaky, float("inf"))
    assert cut.solves == full.solves - 1
    if cut.solution is not None:
        assert p.memory_of(cut.solution.choice) <= p.budget + 1e-9
        assert cut.bound <= opt + 1e-9 <= cut.solution.objective + 2e-9


@pytest.mark.parametrize("seed", range(10))
def test_lower_bound_is_below_the_optimum_and_prunes_only_what_cannot_win(seed: int) -> None:
    """``lower_bound`` never exceeds the exact optimum; ``solve`` with a cutoff at or below it raises
    ``Pruned``, and with a cutoff above the optimum solves as usual."""
    from soybean.search import Pruned, lower_bound

    rng = random.Random(900 + seed)
    p = random_problem(rng, 8, dag=seed % 2 == 0)
    _, opt = brute_force(p)
    lb = lower_bound(reduce(p), p)
    assert lb <= opt + 1e-9
    with pytest.raises(Pruned):
        solve(p, "ilp", cutoff=lb)
    assert solve(p, "ilp", cutoff=opt * 1.5 + 1.0).objective == pytest.approx(opt, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_a_problem_the_reductions_solve_whole_is_bounded_by_its_optimum(seed: int) -> None:
    """A chain reduces to isolated variables with every other folded into them, so ``lower_bound`` (and the
    cutoff ``solve`` prunes at) is the exact optimum: each isolated variable counts what was folded into it, not
    its own unary cost alone (which bounded a whole chain by one variable's cost: a table's bound near zero)."""
    from soybean.search import Pruned, lower_bound

    rng = random.Random(950 + seed)
    p = random_problem(rng, 7, dag=False)
    red = reduce(p)
    assert red.core.n == 0
    _, opt = brute_force(p)
    assert lower_bound(red, p) == pytest.approx(opt, rel=1e-12)
    with pytest.raises(Pruned) as e:
        solve(p, "ilp", cutoff=opt * (1 - 1e-9))
    assert e.value.bound == pytest.approx(opt, rel=1e-12) and e.value.free == e.value.bound


def stack_problem(rng: random.Random, layers: int, size: int, differ: int | None = None) -> Problem:
    """A prologue variable, ``layers`` equal blocks of ``size`` variables (a cycle through each block's first, a
    middle and its last variable, so a core is left inside it) chained last to next first, and one variable every
    block reads (as a stack's layers read the rotary tables); block ``differ`` has other costs."""
    k = [rng.randint(2, 3) for _ in range(size)]
    unary = [np.array([rng.random() for _ in range(n)]) for n in k]
    inner = {(i, j): np.array([[rng.random() * 3 for _ in range(k[j])] for _ in range(k[i])])
             for i in range(size) for j in range(i + 1, size) if j == i + 1 or (i == 0 and j == size - 1)
             or (i == 0 and j == size // 2)}
    link = np.array([[rng.random() * 2 for _ in range(k[0])] for _ in range(k[-1])])
    ext = np.array([[rng.random() for _ in range(k[1])] for _ in range(3)])
    start = np.array([[rng.random() * 2 for _ in range(k[0])] for _ in range(3)])
    p = Problem([np.array([0.5, 0.1, 0.9]), np.array([0.2, 0.4, 0.3])])  # the prologue and the shared variable
    blocks = []
    for b in range(layers):
        base = p.n
        own = [u * (1.5 if b == differ else 1.0) for u in unary]
        p.unary.extend(own)
        for (i, j), C in inner.items():
            p.add_edge(base + i, base + j, C)
        p.add_edge(1, base + 1, ext)  # every block reads the shared variable
        p.add_edge(0 if b == 0 else base - 1, base, start if b == 0 else link)
        blocks.append(tuple(range(base, base + size)))
    p.blocks = tuple(blocks)
    return p


@pytest.mark.parametrize("seed", range(8))
def test_a_stack_reduced_block_by_block_is_reduced_exactly(seed: int) -> None:
    """``reduce_blocks``: each distinct block's inside reduced once, its boundary kept, then the rest: the core
    ``reduce`` leaves of the whole, the same bounds to rounding, and the same optimum, its choices restored by
    ``expand``; one block of other costs is reduced on its own; a problem whose
    blocks all differ is reduced whole."""
    from dataclasses import replace

    from soybean.search import lower_bound
    from soybean.search.problem import reduce_blocks

    rng = random.Random(990 + seed)
    p = stack_problem(rng, layers=3, size=5, differ=2 if seed % 2 else None)
    whole = replace(p, blocks=())
    by, alone = reduce(p), reduce(whole)
    assert reduce_blocks(p) is not None
    assert sorted(by.keep) == sorted(alone.keep) and by.core.n > 0
    assert lower_bound(by, p) == pytest.approx(lower_bound(alone, whole), rel=1e-12)
    opt = solve(whole, "ilp").objective  # the solver on the whole problem (equal to enumeration: tested above)
    got = solve(p, "ilp")
    assert got.objective == pytest.approx(opt, rel=1e-9)
    assert p.evaluate(by.expand(solve_ilp(by.core).choice, p.n)) == pytest.approx(opt, rel=1e-9)
    distinct = replace(p, blocks=p.blocks[:1])
    assert reduce_blocks(distinct) is None


@pytest.mark.parametrize("seed", range(6))
def test_a_tied_stack_reduced_from_its_blocks_has_the_tied_bound(seed: int) -> None:
    """``reduce_tied``: the tied problem's reduction composed from its blocks' (each distinct block's inside once,
    a block tied onto another added onto it) has the core size and bounds of ``tie`` then ``reduce``, to rounding,
    with a cache shared by two calls (the second reduces no block) and with a block too small to reduce alone."""
    from soybean.search import Run, lower_bound, tie
    from soybean.search.diffusion import diffusion_bound
    from soybean.search.problem import reduce_tied

    rng = random.Random(1300 + seed)
    p = stack_problem(rng, layers=5, size=5 if seed % 3 else 3, differ=4 if seed % 2 else None)
    runs = [Run("h", 1, 3, p.blocks[1:4])]
    q, to = tie(p, runs)
    alone = reduce(replace_blocks(q), argmins=False)
    cache: dict = {}
    for _ in range(2):
        tied = reduce_tied(p, to, q.n, cache)
        assert tied.core.n == alone.core.n
        assert lower_bound(tied, q) == pytest.approx(lower_bound(alone, q), rel=1e-12)
        assert diffusion_bound(tied, q, sweeps=30) == pytest.approx(diffusion_bound(alone, q, sweeps=30), rel=1e-9)
    assert len(cache) <= 2


def test_tying_keeps_the_blocks_that_stand_for_themselves() -> None:
    """``tie`` maps each block whose variables are their own representatives onto the tied problem's indices and
    drops the blocks tied onto another."""
    from soybean.search import Run, tie

    p = stack_problem(random.Random(7), layers=4, size=4)
    q, to = tie(p, [Run("h", 1, 2, (p.blocks[1], p.blocks[2]))])
    assert q.blocks == (tuple(to[v] for v in p.blocks[0]), tuple(to[v] for v in p.blocks[1]),
                        tuple(to[v] for v in p.blocks[3]))
    assert solve(q, "ilp").objective == pytest.approx(solve(replace_blocks(q), "ilp").objective, rel=1e-9)


def replace_blocks(q: Problem) -> Problem:
    from dataclasses import replace

    return replace(q, blocks=())


def cyclic_problem(rng: random.Random, n: int) -> Problem:
    """Every variable joined to two or three earlier ones: cycles, so the reductions leave a core."""
    unary = [np.array([rng.random() * 5 for _ in range(rng.randint(2, 4))]) for _ in range(n)]
    p = Problem(unary)
    for v in range(1, n):
        for u in set(rng.sample(range(v), k=min(v, rng.randint(2, 3)))):
            p.add_edge(u, v, np.array([[rng.random() * 10 for _ in unary[v]] for _ in unary[u]]))
    return p


def test_diffusion_bound_lies_between_the_cheap_bound_and_the_optimum() -> None:
    """Every sweep of diffusion is a reparametrisation, so its bound never passes the optimum; it starts at the
    cheap bound's and never falls, and on cores with cycles it gains on it (else it would do nothing).  With a
    target it stops once there (a cutoff it reaches prunes exactly what the cheap bound would)."""
    from soybean.search import lower_bound
    from soybean.search.diffusion import diffusion_bound

    gains = 0
    for seed in range(30):
        rng = random.Random(4100 + seed)
        p = cyclic_problem(rng, rng.randint(6, 9))
        _, opt = brute_force(p)
        red = reduce(p)
        cheap, diffused = lower_bound(red, p), diffusion_bound(red, p, sweeps=50)
        assert cheap - 1e-9 <= diffused <= opt + 1e-9
        gains += diffused > cheap + 1e-9
        if diffused > cheap + 1e-9:
            target = (cheap + diffused) / 2
            assert target <= diffusion_bound(red, p, target) <= diffused + 1e-9
    assert gains >= 10


@pytest.mark.parametrize("seed", range(8))
def test_budgeted_search_with_a_cutoff_prunes_only_what_cannot_win(seed: int) -> None:
    """Under a memory budget the Lagrangian stops once a bound reaches the cutoff.  A cutoff at the
    unbudgeted optimum (the first relaxed solve's value) is pruned at once; a cutoff at the budgeted
    optimum either is pruned with a true lower bound or (a duality gap) solves to that optimum; one
    above it solves to the same optimum as without."""
    from soybean.search import Pruned

    rng = random.Random(1200 + seed)
    p = random_problem(rng, 7, True, budget=True)
    _, opt = brute_force(p)
    _, free = brute_force(replace(p, budget=None, memory=None))
    with pytest.raises(Pruned) as e:
        solve(p, "ilp", gap=0.0, cutoff=free)
    assert e.value.bound <= opt + 1e-9
    try:
        assert solve(p, "ilp", gap=0.0, cutoff=opt).objective == pytest.approx(opt, rel=1e-9)
    except Pruned as pruned:
        assert pruned.bound <= opt + 1e-9
    assert solve(p, "ilp", gap=0.0, cutoff=opt * 1.5 + 1.0).objective == pytest.approx(opt, rel=1e-9)


def test_unique_rows_survive_a_hash_collision() -> None:
    """``_unique_rows`` tells rows apart by a weighted sum; two different rows crafted to the same sum
    are still two classes (the exact check falls back to sorting)."""
    from soybean.search.formulation import _WEIGHTS, _unique_rows

    C = np.zeros((3, 4))
    C[0, 1], C[1, 2], C[2, 1] = _WEIGHTS[2], _WEIGHTS[1], _WEIGHTS[2]  # rows 0 and 1: equal sums, different rows
    assert (C[0] * _WEIGHTS[:4]).sum() == (C[1] * _WEIGHTS[:4]).sum()
    K, inv = _unique_rows(C)
    assert len(K) == 2 and inv[0] == inv[2] != inv[1]
    assert np.array_equal(K[inv], C)


@pytest.mark.parametrize("seed", range(8))
def test_budget_multiplier_search_reaches_the_dual_optimum(seed: int) -> None:
    """The multiplier search stops at ``max L`` (or a closed gap): its bound is at least ``L(lam)`` at
    every multiplier of a fine grid, each ``L(lam)`` computed by enumeration."""
    from soybean.search import _solve_free
    from soybean.search.budget import lagrangian, relaxed

    rng = random.Random(1500 + seed)
    p = random_problem(rng, 6, True, budget=True)
    dual = lagrangian(p, lambda q, cut: _solve_free(q, "ilp", 10.0, 0.0), float("inf"), tol=1e-9)
    _, opt = brute_force(p)
    assert dual.bound <= opt + 1e-9
    top = max(abs(opt), 1.0) / float(p.budget) * 64
    best_l = max(brute_force(relaxed(p, lam))[1] - lam * float(p.budget) for lam in np.linspace(0.0, top, 400))
    assert dual.bound >= best_l - 1e-7 * max(1.0, abs(best_l))


@pytest.mark.parametrize("seed", range(6))
def test_ilp_cutoff_prunes_at_its_lp_bound_and_only_what_cannot_win(seed: int) -> None:
    """``solve_ilp``'s cutoff is checked against its LP relaxation: a cutoff at the LP optimum raises ``Pruned``,
    one just above the exact optimum never does (the LP optimum is a lower bound of every plan)."""
    from soybean.search import Pruned

    rng = random.Random(1300 + seed)
    p = reduce(random_problem(rng, 9, dag=seed % 2 == 0)).core
    if p.n == 0:
        return
    _, opt = brute_force(p)
    lp = solve_ilp(p, gap=1e9).bound  # returned at the LP: its plan's gap is within any target this loose
    assert lp <= opt + 1e-9
    with pytest.raises(Pruned):
        solve_ilp(p, cutoff=lp)
    assert solve_ilp(p, gap=0.0, cutoff=opt + 1e-6 * abs(opt) + 1e-9).objective == pytest.approx(opt, rel=1e-9)
