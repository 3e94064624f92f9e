"""Search: the candidate table (``PlanGraph``) turned into a ``Problem`` and solved.

``solve`` = exact reductions, then the ILP (default) or the DP on the core,
then the eliminated choices restored.  ``kcuts`` is SoyBean's recursive
bisection; ``planner.plan`` adds the mesh-shape search and baselines.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from ..graph import PlanGraph, phase_memory
from .brute import brute_force
from .budget import lagrangian
from .columns import Hints
from .diffusion import diffusion_bound
from .dp import solve_dp
from .ilp import OPTIMAL_GAP, TARGET_GAP, Pruned, SearchError, Solution, relative_gap, solve_ilp
from .problem import Problem, isolated, lower_bound, reduce
from .tying import Run, find_repeats, tie

OBJECTIVES = ("comm", "time")


def to_problem(g: PlanGraph, objective: str, memory_budget: float | None = None,
               overlap: float | None = None, phase: str = "activations", compute_credit: float = 0.0) -> Problem:
    """Unary and pairwise costs of ``g`` under ``objective``.

    ``comm``: bytes sent per device per training step; step seconds are added
    with weight 1 byte/s only to break exact ties towards the faster plan.
    ``time``: modelled seconds, communication + compute, where a fraction
    ``overlap`` (default: the profile's ``grad_overlap``) of every deferred gradient
    all-reduce is taken as hidden behind backward: ``C = seconds - overlap * sync``.
    This linear discount is exact while the hidden time stays below the backward
    compute, the cap ``planner.evaluate`` applies; ``compute_credit`` ``c`` also takes ``c`` times each op's
    compute (its ``compute_s`` less its communication inside) off its cost: with ``overlap = (1 - mu) o`` and
    ``c = mu b`` this is the Lagrangian member ``mu`` of the capped objective (``planner.capped_overlap``).
    ``phase``: the memory the budget constrains (``graph.phase_memory``): the activations phase's, whose
    plan the caller checks against the gradients phase, or ``sum``, both at once.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: use comm or time")
    unary = [v.compute_s.astype(float) for v in g.vars]  # a copy: the credit below is taken in place
    if compute_credit and objective == "time":
        for u, v in zip(unary, g.vars):
            if v.kind == "op":
                u -= compute_credit * (u - (v.op_comm[:, 1] if v.op_comm is not None else 0.0))
    memory = [phase_memory(v, phase) for v in g.vars] if memory_budget else None
    # A plan's peak is its variables' memory less ``g.rerun_credit``: the budget on the sum grows by it.
    budget = memory_budget + g.rerun_credit if memory_budget else None
    p = Problem(unary, {}, memory, budget, [v.name for v in g.vars])
    # Under ``comm`` the seconds only break ties: priced without overlap, a replicated weight's
    # gradient all-reduce and a split weight's gather/reduce-scatter stay tied on time as on bytes.
    ov = 0.0 if objective == "comm" else g.profile.grad_overlap if overlap is None else overlap
    for e in g.edges:
        C = e.seconds - ov * e.sync if e.sync is not None and ov else e.seconds
        p.add_edge(e.src, e.dst, C + e.bytes if objective == "comm" else C)
    return p


def solve(p: Problem, solver: str = "ilp", time_limit_s: float = 60.0, gap: float = TARGET_GAP,
          runs: Sequence[Run] = (), cutoff: float | None = None, enough: float | None = None,
          hints: Hints | None = None) -> Solution:
    """The best choice per variable of ``p`` with ``solver`` in {ilp, dp, brute}: the ILP stops once its
    plan is proven within relative ``gap`` of optimal, or after ``time_limit_s`` with the best plan
    found and its bound.  A memory budget is met by Lagrangian
    relaxation (``budget``), refined by the joint ILP on problems of at most ``REFINE_MAX`` pair costs.
    ``runs``: repeated layers solved tied (``tying``); the bound is then the tied problem's.
    ``cutoff``: raise ``Pruned`` once a lower bound reaches it: the reduction's cheap bound before the
    solve, the ILP's LP relaxation, and under a budget also each Lagrangian bound (``budget.lagrangian``).
    ``enough`` (no budget): the bound the caller can use; a rounded LP plan whose value is below it skips branch
    and bound (``ilp.solve_ilp``), since no bound branch and bound proves exceeds that plan's value.
    ``hints``: the caller's column hints, kept across its solves (``columns.Hints``; None: none kept)."""
    t0 = time.perf_counter()
    if runs:
        q, to = tie(p, list(runs))
        s = solve(q, solver, time_limit_s, gap, cutoff=cutoff, enough=enough, hints=hints)
        choice = [s.choice[to[v]] for v in range(p.n)]
        obj = p.evaluate(choice)  # equal to s.objective: tying prices a plan exactly
        return Solution(choice, obj, obj - (s.objective - s.bound), s.status, time.perf_counter() - t0, s.solver)
    if solver == "brute":
        choice, obj = brute_force(p)
        return Solution(choice, obj, obj, "optimal", time.perf_counter() - t0, "brute")
    if solver not in ("ilp", "dp"):
        raise ValueError(f"unknown solver {solver!r}: use ilp or dp")
    if p.budget is not None and p.memory is not None:
        return _solve_budget(p, solver, time_limit_s, gap, t0, cutoff, hints)
    return _solve_free(p, solver, time_limit_s, gap, t0, cutoff, enough, hints)


def _solve_free(p: Problem, solver: str, time_limit_s: float, gap: float, t0: float | None = None,
                cutoff: float | None = None, enough: float | None = None, hints: Hints | None = None
                ) -> Solution:
    """Exact reductions, then the solver on the core, then the eliminated choices restored."""
    t0 = time.perf_counter() if t0 is None else t0
    red = reduce(p)
    if cutoff is not None:
        bound = lower_bound(red, p)
        if bound < cutoff:  # before the LP, the bound of a few sweeps of diffusion (milliseconds)
            bound = max(bound, diffusion_bound(red, p, cutoff))
        if bound >= cutoff:
            raise Pruned(bound, cutoff)
    if solver == "dp":
        core = solve_dp(red.core)
    else:
        shift = isolated(red, p)  # OPT(p) = OPT(core) + shift
        try:
            core = solve_ilp(red.core, time_limit_s=time_limit_s, gap=gap,
                             cutoff=None if cutoff is None else cutoff - shift,
                             enough=None if enough is None else enough - shift, hints=hints)
        except Pruned as e:  # raised only under a cutoff
            assert cutoff is not None
            raise Pruned(e.bound + shift, cutoff) from None
    choice = red.expand(core.choice, p.n)
    obj = p.evaluate(choice)
    return Solution(choice, obj, obj - (core.objective - core.bound), core.status, time.perf_counter() - t0,
                    core.solver)


# The joint budgeted ILP refines the Lagrangian plan only on problems this small (pair costs in all):
# it cannot be reduced, and a one-layer Llama-3-8B table (675k) takes it a minute.
REFINE_MAX = 150_000


def _solve_budget(p: Problem, solver: str, time_limit_s: float, target: float, t0: float,
                  cutoff: float | None = None, hints: Hints | None = None) -> Solution:
    deadline = t0 + time_limit_s
    dual = lagrangian(p, lambda q, cut: _solve_free(q, solver, max(1.0, deadline - time.perf_counter()), target,
                                                    cutoff=cut, hints=hints),
                      deadline, target, cutoff)
    best, bound = dual.solution, dual.bound
    size = sum(C.size for C in p.edges.values())

    def gap() -> float:
        return float("inf") if best is None else relative_gap(best.objective, bound)

    left = deadline - time.perf_counter()
    if gap() > target and solver == "ilp" and size <= REFINE_MAX and left > 1.0:
        try:
            s = solve_ilp(p, time_limit_s=left, gap=target, hints=hints)
        except SearchError:
            s = None
        if s is not None:
            bound = max(bound, s.bound)
            if best is None or s.objective < best.objective:
                best = s
    if best is None:
        raise SearchError(f"no plan within the memory budget was found in {time_limit_s:g} s: "
                          "give more time (--time-limit) or a larger budget (--memory-gb)")
    status = "optimal" if gap() <= OPTIMAL_GAP else "feasible"
    name = best.solver if dual.solves <= 1 or best.solver.endswith("lagrangian") else f"{best.solver}+lagrangian"
    return Solution(best.choice, best.objective, min(bound, best.objective), status, time.perf_counter() - t0, name)


__all__ = [
    "Problem", "SearchError", "Solution", "solve", "to_problem", "solve_ilp", "solve_dp", "brute_force", "reduce",
    "OBJECTIVES", "TARGET_GAP", "relative_gap", "Run", "find_repeats", "tie", "Pruned", "lower_bound", "Hints",
]
