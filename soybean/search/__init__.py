"""Search: the solvers, a ``Problem`` in (unary and pairwise costs, memory, a budget), a ``Solution`` out.

``solve`` = exact reductions, then the ILP (default) or the DP on the core,
then the eliminated choices restored.  ``kcuts`` is SoyBean's recursive
bisection, ``chain`` the bounds over a chain of recomputation choices, ``tying`` the reduction of repeated layers.
The solvers never read the model: ``planner.problem`` turns a planning graph into a ``Problem`` (``to_problem``)
and ``planner.repeats`` finds its repeated layers; ``planner.plan`` adds the mesh-shape search and baselines.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from .brute import brute_force
from .budget import lagrangian
from .columns import Hints
from .diffusion import diffusion_bound
from .dp import solve_dp
from .frontier import TooLarge, solve_frontier
from .ilp import (
    OPTIMAL_GAP,
    TARGET_GAP,
    Infeasible,
    Pruned,
    SearchError,
    Solution,
    _infeasible,
    relative_gap,
    solve_ilp,
)
from .problem import Problem, isolated, lower_bound, reduce
from .tying import Run, alike, mix_layers, tie


def solve(p: Problem, solver: str = "ilp", time_limit_s: float = 60.0, gap: float = TARGET_GAP,
          runs: Sequence[Run] = (), cutoff: float | None = None, enough: float | None = None,
          hints: Hints | None = None) -> Solution:
    """The best choice per variable of ``p`` with ``solver`` in {ilp, dp, brute}: the ILP stops once its
    plan is proven within relative ``gap`` of optimal, or after ``time_limit_s`` with the best plan
    found and its bound.  A memory budget is met by Lagrangian
    relaxation (``budget``); a duality gap left is closed exactly by elimination over (time, memory) frontiers
    (``frontier``) where the graph is narrow enough, else narrowed by the joint ILP on problems of at most
    ``REFINE_MAX`` pair costs.
    ``runs``: repeated layers solved tied (``tying``); the bound is then the tied problem's, and under a budget
    the Lagrangian's (``ilp.Sides``), the plan the best of the tied one and its mixes layer by layer
    (``_untied``).
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
        bound = obj - (s.objective - s.bound)
        if s.sides is None:
            return Solution(choice, obj, bound, s.status, time.perf_counter() - t0, s.solver, s.free)
        return _untied(p, runs, to, Solution(choice, obj, bound, s.status, 0.0, s.solver, s.free, s.sides), gap,
                       t0 + time_limit_s, t0)
    if solver == "brute":
        choice, obj = brute_force(p)
        return Solution(choice, obj, obj, "optimal", time.perf_counter() - t0, "brute")
    if solver not in ("ilp", "dp"):
        raise ValueError(f"unknown solver {solver!r}: use ilp or dp")
    if p.budget is not None and p.memory is not None:
        return _solve_budget(p, solver, time_limit_s, gap, t0, cutoff, hints)
    return _solve_free(p, solver, time_limit_s, gap, t0, cutoff, enough, hints)


# Points a join of the untied problem's frontier elimination may make (``_untied``): a quarter of the tied problem's,
# so that the exact attempt costs about what the tied one does (a 10-layer transformer on 4 devices: 0.2 s), and
# a stack too large for it falls back to the mixes at once, not at the deadline.
UNTIED_POINTS = 1_000_000


def _untied(p: Problem, runs: Sequence[Run], to: list[int], s: Solution, gap: float, deadline: float,
            t0: float) -> Solution:
    """A tied budgeted solve's plan ``s`` (expanded to ``p``) as a plan of the untied problem ``p``.

    Under a budget the tied problem's own optimum (``frontier``, the joint ILP) bounds only plans that lay the tied
    layers out alike, so the bound is the Lagrangian's (``ilp.Sides``: each relaxed problem is unbudgeted and ties
    exactly).  The plan is the cheapest of ``s``'s and the mixes layer by layer (``tying.mix_layers``) of the
    Lagrangian's plan beyond the budget with its plan within it and with ``s``'s; where that leaves more than
    ``gap``, the frontier elimination of the untied problem closes it exactly when it fits in ``UNTIED_POINTS``
    points a join (and ``deadline``).  The runs the plan still lays out alike are ``Solution.runs``."""
    assert s.sides is not None
    beyond, within = ([x[to[v]] for v in range(p.n)] for x in (s.sides.beyond, s.sides.within))
    best, value, solver = s.choice, s.objective, s.solver
    for other in [within] + ([s.choice] if s.choice != within else []):
        got = mix_layers(p, beyond, other, runs)
        if got is not None and got[1] < value:
            best, value, solver = got[0], got[1], f"{s.solver}+mixed"
    bound = min(s.bound, s.sides.bound, value)
    if relative_gap(value, bound) > gap:
        try:
            exact = solve_frontier(p, value, s.sides.multiplier, deadline, UNTIED_POINTS)
        except TooLarge:
            pass
        else:  # a cheaper plan, the optimum; or proof that none is cheaper than ours
            if exact is not None:
                best, value, solver = exact, p.evaluate(exact), f"{s.solver}+untied"
            bound = value
    status = "optimal" if relative_gap(value, bound) <= OPTIMAL_GAP else "feasible"
    kept = alike(runs, best)
    return Solution(best, value, bound, status, time.perf_counter() - t0, solver, s.free, s.sides,
                    None if kept == list(runs) else tuple(kept), s.choice if best != s.choice else None)


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
            raise Pruned(bound, cutoff, bound)  # a problem without a budget: its bound is its free bound
    if solver == "dp":
        core = solve_dp(red.core)
    else:
        shift = isolated(red)  # OPT(p) = OPT(core) + shift
        try:
            core = solve_ilp(red.core, time_limit_s=time_limit_s, gap=gap,
                             cutoff=None if cutoff is None else cutoff - shift,
                             enough=None if enough is None else enough - shift, hints=hints)
        except Pruned as e:  # raised only under a cutoff
            assert cutoff is not None
            raise Pruned(e.bound + shift, cutoff, e.bound + shift) from None
    choice = red.expand(core.choice, p.n)
    obj = p.evaluate(choice)
    bound = obj - (core.objective - core.bound)
    return Solution(choice, obj, bound, core.status, time.perf_counter() - t0, core.solver, bound)


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

    if gap() > target and (cutoff is None or bound < cutoff):
        # The exact frontier elimination closes the duality gap where the graph allows (``frontier``): a plan
        # below the Lagrangian's (and the cutoff), or proof that none is.
        upper = min(best.objective if best is not None else float("inf"),
                    cutoff if cutoff is not None else float("inf"))
        try:
            choice = solve_frontier(p, upper, dual.multiplier, deadline)
        except TooLarge:
            pass
        else:
            if choice is not None:
                obj = p.evaluate(choice)
                best = Solution(choice, obj, obj, "optimal", time.perf_counter() - t0, "frontier")
                bound = obj
            elif cutoff is not None and (best is None or cutoff <= best.objective):
                raise Pruned(cutoff, cutoff, dual.free)  # no fitting plan lies below the cutoff
            elif best is None:
                raise _infeasible(p, time_limit_s)  # nothing fits: the ILP's own error for it
            else:
                bound = best.objective  # no fitting plan is cheaper: the Lagrangian's plan is optimal
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
    return Solution(best.choice, best.objective, min(bound, best.objective), status, time.perf_counter() - t0, name,
                    dual.free, dual.sides)


__all__ = [
    "Problem", "SearchError", "Solution", "solve", "solve_ilp", "solve_dp", "brute_force", "reduce",
    "TARGET_GAP", "relative_gap", "Run", "tie", "Pruned", "Infeasible", "lower_bound", "Hints",
]
