"""Exact search as an integer linear programme, solved by HiGHS.

Variables: ``x[v,s] in {0,1}`` (variable ``v`` takes strategy ``s``) and, per edge
``(u,v)``, ``y[e,s,t] >= 0`` (the pair is chosen).

    (one strategy)      sum_s x[v,s] = 1
    (edge marginals)    sum_t y[e,s,t] = x[u,s],  sum_s y[e,s,t] = x[v,t]
    (memory, optional)  sum_v sum_s m[v,s] x[v,s] <= M
    minimise            sum_v sum_s c[v,s] x[v,s] + sum_e sum_st C_e[s,t] y[e,s,t]

The marginal form (rather than ``y >= x_u + x_v - 1``) has an LP relaxation that is exact on
trees and, on the cores ``problem.reduce`` leaves, almost always integral.  So the LP relaxation is
solved first: an integral LP optimum is the ILP optimum, proven by its own objective (a one-layer
Llama-3-8B core on a 2x2x2 mesh, 239k columns: 2.5 s as an LP, 18 s through the MIP solver).  Only a
fractional one goes on to branch and bound, within the time limit, starting from the LP's bound;
without a budget every choice is a plan, so the rounded LP solution is the fallback when branch and
bound finds none in time.

The formulation is built once as arrays (``formulation``, a sparse matrix) and handed to HiGHS
through ``highspy`` (``highs``; a Python loop over 239k columns through ``pywraplp`` took 6 s; OR-Tools' model
builder, which also takes arrays, hid HiGHS's status for a solve stopped at a cutoff).  A core of at least
``columns.COLUMNS_MIN`` pair columns has its LP solved by column generation (``columns``), to a proven bound.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import columns
from .formulation import formulate
from .highs import solve_formulation
from .problem import Problem

if TYPE_CHECKING:
    from .tying import Run


@dataclass(frozen=True)
class Sides:
    """A budgeted solve's Lagrangian plans at its peak, one ``beyond`` the budget and one ``within`` it, and the
    dual's best ``bound``.  Of a tied problem (``tying``), that bound holds for the untied one too, since each
    relaxed problem is unbudgeted and ties exactly; the tied problem's own optimum (``frontier``, the joint ILP)
    does not: under a budget, layers laid out alike are a real restriction, and the plans between the two sides
    are the mixes of their layers (``tying.mix_layers``).  ``budget.lagrangian`` finds them."""

    beyond: list[int]
    within: list[int]
    bound: float
    multiplier: float = 0.0  # the multiplier of ``bound`` (``frontier`` prunes by its relaxed costs)


@dataclass
class Solution:
    choice: list[int]
    objective: float
    bound: float
    status: str
    seconds: float
    solver: str
    # A lower bound of the problem without its memory budget: the relaxed problem's at multiplier 0 where a budget
    # was relaxed (``budget.lagrangian``), ``bound`` itself where there was none; -inf: not known.  A planner bounds
    # other problems by it whose costs are at least these everywhere (``planner.recompute``: more recomputed).
    free: float = -math.inf
    # A budgeted solve's Lagrangian plans on either side of its peak and its bound (``Sides``), for ``solve``
    # to mix layer by layer where the problem was tied.  None: none (no budget, or it never bound).
    sides: Sides | None = None
    # The repeated layers the plan still lays out alike, where a mix cut a run of those it was solved with (the
    # runs split at the cut, ``tying.mix_layers``); None: all of them.
    runs: tuple[Run, ...] | None = None
    # The tied solve's own plan where a mix or the untied elimination replaced it: every layer alike, it may make a
    # better plan of another problem than the one that replaced it (``planner.recompute``'s ``shift``).
    tied: list[int] | None = None


class SearchError(ValueError):
    """No plan: the constraints cannot be met, or the solver found none; the message names the fix."""


class Infeasible(SearchError):
    """No plan satisfies the problem's memory budget: proven, not a solve that ran out of time."""


def _infeasible(p: Problem, time_limit_s: float) -> SearchError:
    """The error for a solve HiGHS calls infeasible: the budget when there is one; else (every plan is allowed)
    the solver gave up, which it reports so on problems too large for its time."""
    if p.budget is not None:
        return Infeasible("no plan satisfies the memory budget: raise it")
    return SearchError(f"the ILP solver gave up within {time_limit_s:g} s on a problem of {p.n} variables with no "
                       "memory constraint: give more time (--time-limit) or use --solver dp")


class Pruned(SearchError):
    """The problem's lower bound (``problem.lower_bound``, or a Lagrangian bound) already reaches the
    cutoff: no plan of it can beat the plan the cutoff came from, so it was not solved."""

    def __init__(self, bound: float, cutoff: float, free: float = -math.inf) -> None:
        # ``free``: a lower bound of the problem without its memory budget, where one was found (``Solution.free``)
        self.bound, self.cutoff, self.free = bound, cutoff, free
        super().__init__(f"lower bound {bound:.6g} >= cutoff {cutoff:.6g}: not solved")

    def __reduce__(self) -> tuple:  # rebuilt from its fields, not its message (a planner worker sends it)
        return (Pruned, (self.bound, self.cutoff, self.free))


# A plan proven within this relative distance of the bound is reported "optimal".
OPTIMAL_GAP = 1e-6
# By default the search stops once its plan is proven within 0.01% of optimal (HiGHS's own MIP
# default): a rounded LP plan that close skips branch and bound (a Llama-3-8B layer: 1.6 s, not 7 s).
TARGET_GAP = 1e-4

def solve_ilp(p: Problem, *, time_limit_s: float = 60.0, gap: float = TARGET_GAP,
              cutoff: float | None = None, enough: float | None = None, hints: columns.Hints | None = None
              ) -> Solution:
    """``_solve_ilp`` on ``p`` with costs below 1/2 scaled up by a power of two to a largest cost between 1/2 and 1
    (exact in floating point), and the result scaled back.  HiGHS's tolerances are absolute (1e-7 on reduced
    costs): a step time of tens of microseconds has pair costs below them, and on such a table HiGHS called a plan
    optimal at gap 0 that was 0.04% above the optimum (``frontier`` found it; scaled, HiGHS found it too)."""
    top = max((float(np.abs(t).max(initial=0.0)) for t in [*p.unary, *p.edges.values()]), default=0.0)
    if top == 0.0 or not np.isfinite(top):
        return _solve_ilp(p, time_limit_s, gap, cutoff, enough, hints)
    k = 2.0 ** -math.ceil(math.log2(top))
    if k <= 1.0:  # scaled up only: a ``comm`` table's bytes keep their seconds added to break ties above 1e-7
        return _solve_ilp(p, time_limit_s, gap, cutoff, enough, hints)
    q = Problem([u * k for u in p.unary], {e: C * k for e, C in p.edges.items()}, p.memory, p.budget, p.names)
    try:
        s = _solve_ilp(q, time_limit_s, gap, None if cutoff is None else cutoff * k,
                       None if enough is None else enough * k, hints)
    except Pruned as e:
        assert cutoff is not None
        raise Pruned(e.bound / k, cutoff, e.free / k) from None
    obj = p.evaluate(s.choice)
    return Solution(s.choice, obj, min(s.bound / k, obj), s.status, s.seconds, s.solver, s.free / k)


def _solve_ilp(p: Problem, time_limit_s: float, gap: float, cutoff: float | None, enough: float | None,
               hints: columns.Hints | None) -> Solution:
    """The best choice for ``p`` proven within relative ``gap`` of optimal, or the best found within
    ``time_limit_s``, always with the bound proven so far (status ``optimal`` only when proven within
    ``OPTIMAL_GAP``); ``SearchError`` when there is none; ``Pruned`` when the LP relaxation's optimum (a lower
    bound of every plan) already reaches ``cutoff``.

    LP relaxation first; an integral LP optimum is optimal.  A fractional one is rounded (each
    variable's largest ``x``); when the rounded plan is within ``gap`` of the LP bound it is returned,
    else branch and bound runs for the time left, and the better of its plan and the rounded one wins.
    ``enough``: the least bound of use to the caller (``planner.capped_overlap``: the one that would prove its plan
    within the gap).  Branch and bound only lifts the bound towards the optimum, which is at most the rounded plan's
    value; a rounded plan below ``enough`` is returned with the LP's bound (GPT-2's 3-D members: 3 s each to prove
    a rounded plan 0.18% above its LP optimal, where the overlap's duality gap is 2.6%).
    ``hints``: the caller's column hints for a large core's LP (``columns.Hints``; None: none kept).
    """
    t0 = time.perf_counter()
    name = "ilp-highs"
    if p.n == 0:
        return Solution([], 0.0, 0.0, "optimal", 0.0, name)
    f = formulate(p)
    lp = None
    if f.num_col - int(f.x_start[-1]) >= columns.COLUMNS_MIN:  # a large core: the LP by columns
        lp = columns.solve_by_columns(p, f, time_limit_s, gap / 10, cutoff, hints)
    status, values, bound = lp or solve_formulation(f, False, time_limit_s, gap, cutoff)
    if status == "infeasible":
        raise _infeasible(p, time_limit_s)
    if status == "cutoff":
        assert cutoff is not None
        raise Pruned(bound, cutoff, bound if p.budget is None else -math.inf)
    candidates = [f.choice(values)] if values is not None else []
    fits = [c for c in candidates if _fits(p, c)]
    lp_bound = bound if status == "optimal" else -float("inf")
    if cutoff is not None and lp_bound >= cutoff:
        raise Pruned(lp_bound, cutoff, lp_bound if p.budget is None else -math.inf)
    rounded = p.evaluate(fits[0]) if fits else None
    if rounded is not None and status == "optimal" and (relative_gap(rounded, lp_bound) <= gap
                                                        or (enough is not None and rounded < enough)):
        return _best(p, fits, lp_bound, name, t0)
    left = time_limit_s - (time.perf_counter() - t0)
    if left > 0.1:
        start = min(fits, key=p.evaluate) if fits else None  # the rounded LP plan: an incumbent from the start
        status, values, bound = solve_formulation(f, True, left, gap, start=start)
        if status == "infeasible":
            raise _infeasible(p, time_limit_s)
        if values is not None:
            fits += [c for c in [f.choice(values)] if _fits(p, c)]
        lp_bound = max(lp_bound, bound)
    if not fits:
        raise SearchError(f"the ILP solver found no plan within {time_limit_s:g} s ({status}): "
                          "give more time (--time-limit) or use --solver dp")
    return _best(p, fits, lp_bound, name, t0)


def _fits(p: Problem, choice: list[int]) -> bool:
    return p.budget is None or p.memory_of(choice) <= p.budget * (1 + 1e-9)


def _best(p: Problem, fits: list[list[int]], bound: float, name: str, t0: float) -> Solution:
    choice = min(fits, key=p.evaluate)
    obj = p.evaluate(choice)
    bound = min(bound, obj)
    status = "optimal" if relative_gap(obj, bound) <= OPTIMAL_GAP else "feasible"
    free = bound if p.budget is None else -math.inf  # a budgeted ILP's bound holds only under its budget
    return Solution(choice, obj, bound, status, time.perf_counter() - t0, name, free)


def relative_gap(objective: float, bound: float) -> float:
    """``(objective - bound) / |objective|``: how far a plan may be from optimal (0: proven optimal)."""
    if objective == bound:
        return 0.0
    return max(0.0, objective - bound) / abs(objective) if objective else float("inf")
