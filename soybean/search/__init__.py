"""Search: the candidate table (``PlanGraph``) turned into a ``Problem`` and solved.

``solve`` = exact reductions, then the ILP (default) or the DP on the core,
then the eliminated choices restored.  ``kcuts`` is SoyBean's recursive
bisection; ``planner.plan`` adds the mesh-shape search and baselines.
"""
from __future__ import annotations

import time

from ..graph import PlanGraph
from .brute import brute_force
from .dp import solve_dp
from .ilp import SearchError, Solution, solve_ilp
from .problem import Problem, reduce

OBJECTIVES = ("comm", "time")


def to_problem(g: PlanGraph, objective: str, memory_budget: float | None = None,
               overlap: float | None = None) -> Problem:
    """Unary and pairwise costs of ``g`` under ``objective``.

    ``comm``: bytes sent per device per training step; step seconds are added
    with weight 1 byte/s only to break exact ties towards the faster plan.
    ``time``: modelled seconds, communication + compute, where a fraction
    ``overlap`` (default: the profile's ``grad_overlap``) of every deferred gradient
    all-reduce is taken as hidden behind backward: ``C = seconds - overlap * sync``.
    This linear discount is exact while the hidden time stays below the backward
    compute, the cap ``planner.evaluate`` applies (see ``planner.solve_on``).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: use comm or time")
    unary = [v.compute_s.astype(float).copy() for v in g.vars]
    memory = [v.memory for v in g.vars] if memory_budget else None
    p = Problem(unary, {}, memory, memory_budget, [v.name for v in g.vars])
    # Under ``comm`` the seconds only break ties: priced without overlap, a replicated weight's
    # gradient all-reduce and a split weight's gather/reduce-scatter stay tied on time as on bytes.
    ov = 0.0 if objective == "comm" else g.profile.grad_overlap if overlap is None else overlap
    for e in g.edges:
        C = e.seconds - ov * e.sync if e.sync is not None and ov else e.seconds
        C = C + (e.bytes if objective == "comm" else 0.0)
        p.add_edge(e.src, e.dst, C)
    return p


def solve(p: Problem, solver: str = "ilp", time_limit_s: float = 60.0) -> Solution:
    """Optimal choice per variable of ``p`` with ``solver`` in {ilp, dp, brute} (the ILP stops after
    ``time_limit_s`` with the best plan found and its bound)."""
    t0 = time.perf_counter()
    if solver == "brute":
        choice, obj = brute_force(p)
        return Solution(choice, obj, obj, "optimal", time.perf_counter() - t0, "brute")
    red = reduce(p)
    if solver == "dp":
        core = solve_dp(red.core)
    elif solver == "ilp":
        core = solve_ilp(red.core, time_limit_s=time_limit_s)
    else:
        raise ValueError(f"unknown solver {solver!r}: use ilp or dp")
    choice = red.expand(core.choice, p.n)
    obj = p.evaluate(choice)
    gap = core.objective - core.bound
    return Solution(choice, obj, obj - gap, core.status, time.perf_counter() - t0, core.solver)


__all__ = [
    "Problem", "SearchError", "Solution", "solve", "to_problem", "solve_ilp", "solve_dp", "brute_force", "reduce",
    "OBJECTIVES",
]
