"""The memory budget, solved by Lagrangian relaxation with a certificate.

The budgeted problem

    OPT = min_s  cost(s)   subject to   mem(s) = sum_v m_v[s_v] <= M

couples every variable, so none of ``problem.reduce``'s exact eliminations applies and the ILP
must take the whole table (a one-layer Llama-3-8B on a 2x2x2 mesh: 675k pair variables, a minute).
Instead, for a multiplier ``lam >= 0`` the relaxed problem

    L(lam) = min_s  cost(s) + lam * (mem(s) - M)

is unbudgeted again (``lam * m_v`` joins the unary costs), so it reduces to a small core and solves
in well under a second, and weak duality makes every ``L(lam)`` a lower bound of ``OPT``; a solution
of the relaxed problem that fits is an upper bound.  So:

1. ``lam = 0``: the unbudgeted optimum.  If it fits, it is the budgeted optimum (gap 0).
2. Otherwise grow ``lam`` until a relaxed solution fits.  Every plan ``s`` found is a line
   ``cost(s) + lam * (mem(s) - M)`` above ``L``; the next multiplier is where the line of the last plan
   that does not fit crosses the line of the last that does (Kelley's cutting plane in one dimension,
   a secant step: the peak of the lower envelope of the lines known).  A plan found there that lies
   no lower than that peak shows the peak is ``max L``; otherwise it replaces the line on its side.
   Finitely many plans make finitely many steps (a 70B-parameter Llama under a binding budget: ~5
   relaxed solves, where bisecting the multiplier took tens).  The cheapest fitting plan is the upper
   bound and the largest ``L(lam)`` the lower bound (the inner solves' own bounds are used, so an inner
   time-out only weakens it).  The search stops at ``max L``, when the relative gap is below ``tol``,
   when the multipliers meet, or at the deadline.
   With a ``cutoff`` (the best step time another mesh reached), the search stops as soon as a bound
   reaches it, raising ``Pruned``: each relaxed solve gets ``cutoff + lam * M`` as its own cutoff
   (``L(lam) >= cutoff`` exactly when the relaxed optimum reaches it), so a mesh that cannot win
   costs one cheap bound, or one relaxed solve, instead of a bisection.
3. The caller refines with the joint ILP when the problem is small enough and a gap remains
   (``search.solve``): ``L`` is piecewise linear and concave, and its maximum can stay below ``OPT``
   (the duality gap of an integer programme), which only the ILP closes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .ilp import Pruned, SearchError, Sides, Solution
from .problem import Problem

# Multiplier steps at most.
MAX_STEPS = 40


@dataclass
class Dual:
    """The best fitting solution found, the best lower bound, and how many relaxed solves it took."""

    solution: Solution | None   # None: no relaxed solution fitted (the caller raises)
    bound: float
    solves: int
    multiplier: float = 0.0     # the multiplier of the best bound (``frontier`` prunes by its relaxed costs)
    free: float = -float("inf")  # the bound at multiplier 0: of the problem without its budget (``Solution.free``)
    # The relaxed plans of the last two lines on either side of the dual's peak, one beyond the budget and one
    # within, with the bound (None until the search has both).  Plans between them, which no multiplier finds, are
    # where the duality gap is: a stack of repeated layers makes them by mixing the two layer by layer
    # (``tying.mix_layers``).
    sides: Sides | None = None


def relaxed(p: Problem, lam: float) -> Problem:
    """``p`` without its budget, with ``lam * m_v`` added to every unary cost."""
    assert p.memory is not None
    return Problem([u + lam * m for u, m in zip(p.unary, p.memory)], p.edges, None, None, p.names, p.blocks)


def lagrangian(p: Problem, solve_free: Callable[[Problem, float | None], Solution], deadline: float,
               tol: float = 1e-6, cutoff: float | None = None) -> Dual:
    """Search the multiplier of ``p``'s budget (see the module docstring); ``solve_free(q, cut)`` solves an
    unbudgeted problem and returns a ``Solution`` whose ``bound`` is valid for that problem, or raises
    ``Pruned`` when a lower bound of it reaches ``cut`` (``None``: no cutoff).  ``Pruned`` (with a
    bound of ``p``) when a bound of ``p`` reaches ``cutoff``."""
    assert p.memory is not None and p.budget is not None
    M = float(p.budget)
    best: Solution | None = None
    bound = -float("inf")
    solves = 0
    best_lam = 0.0
    at_zero = -float("inf")  # the relaxed problem's bound at multiplier 0, once solved there
    beyond: list[int] | None = None  # the plan of the last line beyond the budget (``lo_line``), and within it
    within: list[int] | None = None

    def at(lam: float) -> tuple[Solution, bool]:
        nonlocal best, bound, solves, best_lam, at_zero
        try:  # SearchError (time ran out): caught below, the best so far stands
            s = solve_free(relaxed(p, lam), None if cutoff is None else cutoff + lam * M)
        except Pruned as e:  # only raised under a cutoff
            assert cutoff is not None
            raise Pruned(e.bound - lam * M, cutoff, e.bound if lam == 0.0 else at_zero) from None
        solves += 1
        if lam == 0.0:
            at_zero = s.bound
        if s.bound - lam * M > bound:
            bound, best_lam = s.bound - lam * M, lam
        if cutoff is not None and bound >= cutoff:
            raise Pruned(bound, cutoff, at_zero)
        fits = p.memory_of(s.choice) <= M
        if fits:
            obj = p.evaluate(s.choice)
            if best is None or obj < best.objective:
                best = Solution(s.choice, obj, obj, s.status, s.seconds, s.solver)
        return s, fits

    def gap() -> float:
        if best is None:
            return float("inf")
        return (best.objective - bound) / max(abs(best.objective), 1e-300)

    def line(sol: Solution) -> tuple[float, float]:
        """``sol``'s line in the dual: ``L(lam) <= cost + lam * (mem - M)``."""
        return p.evaluate(sol.choice), p.memory_of(sol.choice)

    def done() -> Dual:
        sides = Sides(beyond, within, bound, best_lam) if beyond is not None and within is not None else None
        return Dual(best, bound, solves, best_lam, at_zero, sides)

    try:
        free, fits = at(0.0)
        if fits:
            return done()
        # A first multiplier that makes memory matter: the unbudgeted cost spread over the budget.
        lo, hi = 0.0, max(abs(free.objective), 1e-30) / max(M, 1.0)
        lo_line, beyond = line(free), free.choice
        while not (got := at(hi))[1]:
            lo, hi, lo_line, beyond = hi, hi * 8.0, line(got[0]), got[0].choice
            if solves > MAX_STEPS or time.perf_counter() > deadline:
                return done()
        hi_line, within = line(got[0]), got[0].choice
        for _ in range(MAX_STEPS):
            if gap() <= tol or time.perf_counter() > deadline or hi - lo <= 1e-12 * hi:
                break
            (c1, m1), (c2, m2) = lo_line, hi_line  # m1 > M >= m2: slopes of opposite signs
            lam = (c2 - c1) / (m1 - m2)             # where the two lines cross: the envelope's peak
            if not lo < lam < hi:
                lam = (lo + hi) / 2                 # rounding: fall back to bisection
            peak = c1 + lam * (m1 - M)
            sol, fits = at(lam)
            c, m = line(sol)
            if c + lam * (m - M) >= peak - tol * abs(peak):
                break  # no plan lies below the peak: it is max L, the best bound this relaxation gives
            if fits:
                hi, hi_line, within = lam, (c, m), sol.choice
            else:
                lo, lo_line, beyond = lam, (c, m), sol.choice
    except Pruned:
        raise
    except SearchError:  # a relaxed solve ran out of time: the fitting plan and the bound found so far stand
        pass
    return done()
