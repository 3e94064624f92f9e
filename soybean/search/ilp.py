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

The formulation is built once as arrays (``Formulation``, a sparse matrix) and handed to HiGHS whole
through ``highspy`` (a Python loop over 239k columns through ``pywraplp`` took 6 s; OR-Tools' model builder,
which also takes arrays, hid HiGHS's status for a solve stopped at a cutoff).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .problem import Problem


@dataclass
class Solution:
    choice: list[int]
    objective: float
    bound: float
    status: str
    seconds: float
    solver: str


class SearchError(ValueError):
    """No plan: the constraints cannot be met, or the solver found none; the message names the fix."""


def _infeasible(p: Problem, time_limit_s: float) -> SearchError:
    """The error for a solve HiGHS calls infeasible: the budget when there is one; else (every plan is allowed)
    the solver gave up, which it reports so on problems too large for its time."""
    if p.budget is not None:
        return SearchError("no plan satisfies the memory budget: raise it")
    return SearchError(f"the ILP solver gave up within {time_limit_s:g} s on a problem of {p.n} variables with no "
                       "memory constraint: give more time (--time-limit) or use --solver dp")


class Pruned(SearchError):
    """The problem's lower bound (``problem.lower_bound``, or a Lagrangian bound) already reaches the
    cutoff: no plan of it can beat the plan the cutoff came from, so it was not solved."""

    def __init__(self, bound: float, cutoff: float) -> None:
        self.bound, self.cutoff = bound, cutoff
        super().__init__(f"lower bound {bound:.6g} >= cutoff {cutoff:.6g}: not solved")

    def __reduce__(self) -> tuple:  # rebuilt from its fields, not its message (a planner worker sends it)
        return (Pruned, (self.bound, self.cutoff))


@contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """Discard whatever native code writes to file descriptor 1 meanwhile: HiGHS prints its banner
    there even with output suppressed, which would corrupt ``soybean plan --format json`` (and on
    stderr would break ``--quiet``).  The solver's outcome reaches the caller through its status."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


@dataclass
class Formulation:
    """The LP in column-wise arrays: ``x`` columns first (``x_start[v]``, one per strategy), then ``y``.

    ``rows`` lower/upper bounds; the constraint matrix in coordinate form (``row``, ``col``, ``val``).
    """

    cost: np.ndarray
    offset: float
    row: np.ndarray
    col: np.ndarray
    val: np.ndarray
    row_lo: np.ndarray
    row_hi: np.ndarray
    x_start: np.ndarray        # first x column of each variable; x_start[n] = number of x columns

    @property
    def num_col(self) -> int:
        return len(self.cost)

    @property
    def num_row(self) -> int:
        return len(self.row_lo)

    def choice(self, values: np.ndarray) -> list[int]:
        """The strategy each variable takes in a solution vector (its largest ``x``)."""
        return [int(np.argmax(values[self.x_start[v]:self.x_start[v + 1]])) for v in range(len(self.x_start) - 1)]

    def integral(self, values: np.ndarray, tol: float = 1e-6) -> bool:
        x = values[:self.x_start[-1]]
        return bool(np.all((x < tol) | (x > 1 - tol)))


def _classes(C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``C`` with equal rows and equal columns merged: ``(K, ri, ci)`` with ``C[s, t] = K[ri[s], ci[t]]``.

    Strategies of one side that price the edge alike (a matmul's many strategies with one output
    tiling) share its pair variables: ``y`` ranges over classes, and a class's marginal is the sum of
    its members' ``x``.  Exact: an integral ``x`` fixes one class per side and so ``y``; and any
    fractional solution of either form maps to one of the other with the same ``x`` and cost
    (aggregate ``y``, or split it in proportion to the members' ``x``), so the LP bound is unchanged.
    A Llama-3-8B 3-D core has ~1.9 million pair columns before merging."""
    K, ri = _unique_rows(C)
    Kt, ci = _unique_rows(np.ascontiguousarray(K.T))
    return Kt.T, ri, ci


_WEIGHTS = np.random.default_rng(0).random(1 << 16) + 0.5


def _unique_rows(C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of ``C`` and each row's index into them.  Rows are told apart by a random
    weighted sum (equal rows sum alike), checked exactly; a collision falls back to sorting the rows,
    ten times slower."""
    if C.shape[1] <= len(_WEIGHTS):
        h = (C * _WEIGHTS[:C.shape[1]]).sum(axis=1)
        _, first, inv = np.unique(h, return_index=True, return_inverse=True)
        K = C[first]
        if np.array_equal(K[inv], C):
            return K, inv.reshape(-1)
    K, inv = np.unique(C, axis=0, return_inverse=True)
    return K, inv.reshape(-1)


def _separable(C: np.ndarray) -> bool:
    """``C[s, t] = f(s) + g(t)`` exactly: the edge then needs no pair variables."""
    return bool(np.array_equal(C, C[:, :1] + (C[:1, :] - C[0, 0])))


def formulate(p: Problem) -> Formulation:
    """The arrays of ``p``'s ILP (module docstring), vectorised per edge."""
    sizes = np.array([len(c) for c in p.unary], dtype=np.int64)
    x_start = np.concatenate([[0], np.cumsum(sizes)])
    nx = int(x_start[-1])
    cost_parts = [np.concatenate([np.asarray(c, dtype=float) for c in p.unary])] if p.n else [np.zeros(0)]
    x_cost = cost_parts[0]
    rows_r = [np.repeat(np.arange(p.n), sizes)]            # one-strategy rows: every x with coefficient 1
    rows_c = [np.arange(nx)]
    rows_v = [np.ones(nx)]
    lo = [np.ones(p.n)]
    hi = [np.ones(p.n)]
    nrow, ncol, offset = p.n, nx, 0.0
    for (u, v), C in p.edges.items():
        C, ri, ci = _classes(C)
        a, b = C.shape
        if a == 1 or b == 1 or _separable(C):  # the edge is linear in the two sides' choices
            x_cost[x_start[v]:x_start[v + 1]] += (C[0] - C[0, 0])[ci]
            x_cost[x_start[u]:x_start[u + 1]] += C[:, 0][ri]
            continue
        base = float(C.min())  # constant offset keeps the LP well scaled
        offset += base
        y = ncol + np.arange(a * b)                        # y[r, c] at column ncol + r * b + c
        cost_parts.append((C - base).ravel())
        ru, rv = nrow + np.arange(a), nrow + a + np.arange(b)
        r_idx, c_idx = np.divmod(np.arange(a * b), b)
        # sum_c y[r,c] - sum_{s in r} x[u,s] = 0  and  sum_r y[r,c] - sum_{t in c} x[v,t] = 0
        rows_r += [ru[r_idx], rv[c_idx], ru[ri], rv[ci]]
        rows_c += [y, y, x_start[u] + np.arange(len(ri)), x_start[v] + np.arange(len(ci))]
        rows_v += [np.ones(a * b), np.ones(a * b), -np.ones(len(ri)), -np.ones(len(ci))]
        lo.append(np.zeros(a + b))
        hi.append(np.zeros(a + b))
        nrow += a + b
        ncol += a * b
    if p.budget is not None and p.memory is not None:
        rows_r.append(np.full(nx, nrow))
        rows_c.append(np.arange(nx))
        rows_v.append(np.concatenate([np.asarray(m, dtype=float) for m in p.memory]))
        lo.append(np.array([-np.inf]))
        hi.append(np.array([float(p.budget)]))
        nrow += 1
    return Formulation(np.concatenate(cost_parts), offset, np.concatenate(rows_r), np.concatenate(rows_c),
                       np.concatenate(rows_v), np.concatenate(lo), np.concatenate(hi), x_start)


def _run(f: Formulation, integer: bool, time_limit_s: float, gap: float,
         cutoff: float | None = None) -> tuple[str, np.ndarray | None, float]:
    """Solve ``f`` (as an LP, or with integral ``x``) with HiGHS (``highspy``, which takes the arrays whole):
    (status, column values, proven bound).  ``cutoff`` (the LP only): the dual simplex stops as soon as its
    objective, a lower bound at every iteration, reaches it (HiGHS's ``objective_bound``), status ``cutoff``
    with the cutoff as the bound: the problem cannot beat the plan the cutoff came from (half an LP solve on a
    Llama-3-8B 3-D core that the incumbent prunes)."""
    import highspy
    import scipy.sparse as sp

    A = sp.csc_matrix((f.val, (f.row, f.col)), shape=(f.num_row, f.num_col))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = f.num_col, f.num_row
    lp.col_cost_, lp.offset_ = f.cost, f.offset
    lp.col_lower_, lp.col_upper_ = np.zeros(f.num_col), np.ones(f.num_col)
    lp.row_lower_, lp.row_upper_ = f.row_lo, f.row_hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    if integer:
        nx = int(f.x_start[-1])  # the x columns are integral, the pair columns continuous
        lp.integrality_ = [highspy.HighsVarType.kInteger] * nx + [highspy.HighsVarType.kContinuous] * (f.num_col - nx)
    with native_stdout_silenced():  # the banner is printed when the object is made
        _fresh_scheduler(highspy)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)  # one per process: the planner runs one process per core (``mesh_pool``)
        h.setOptionValue("time_limit", max(0.1, float(time_limit_s)))
        if integer:
            h.setOptionValue("mip_rel_gap", float(gap))
        else:
            # HiGHS's presolve costs the LP more than it saves on these tables (a Llama-3-8B 2x2x2 core of 739k
            # columns: 4.5 s with it, 1.6 s without); branch and bound keeps it.
            h.setOptionValue("presolve", "off")
            if cutoff is not None:
                h.setOptionValue("objective_bound", float(cutoff))
        h.passModel(lp)
        h.run()
    st = h.getModelStatus()
    info = h.getInfo()
    M = highspy.HighsModelStatus
    has = info.primal_solution_status == 2  # a feasible point
    values = np.asarray(h.getSolution().col_value, dtype=float) if has else None
    if st == M.kInfeasible:
        return "infeasible", None, float("inf")
    if st == M.kObjectiveBound:
        return "cutoff", None, float(cutoff) if cutoff is not None else -float("inf")
    bound = float(info.mip_dual_bound) if integer else float(info.objective_function_value)
    if st == M.kOptimal:
        return "optimal", values, bound
    if has:
        return "time_limit", values, bound if integer and np.isfinite(bound) else -float("inf")
    return f"error ({h.modelStatusToString(st)})", None, -float("inf")


_SCHEDULER_PID: list[int] = []  # the process whose HiGHS thread scheduler is set up


def _fresh_scheduler(highspy: Any) -> None:
    """HiGHS's thread scheduler made anew in a process forked from one that had set it up (a planner worker,
    ``mesh_pool``): a fork copies the scheduler's state but not its threads, and branch and bound then waits
    for threads that do not exist."""
    pid = os.getpid()
    if _SCHEDULER_PID and _SCHEDULER_PID[0] != pid:
        highspy.Highs.resetGlobalScheduler(True)
    _SCHEDULER_PID[:] = [pid]


# A plan proven within this relative distance of the bound is reported "optimal".
OPTIMAL_GAP = 1e-6
# By default the search stops once its plan is proven within 0.01% of optimal (HiGHS's own MIP
# default): a rounded LP plan that close skips branch and bound (a Llama-3-8B layer: 1.6 s, not 7 s).
TARGET_GAP = 1e-4

def solve_ilp(p: Problem, *, time_limit_s: float = 60.0, gap: float = TARGET_GAP,
              cutoff: float | None = None) -> Solution:
    """The best choice for ``p`` proven within relative ``gap`` of optimal, or the best found within
    ``time_limit_s``, always with the bound proven so far (status ``optimal`` only when proven within
    ``OPTIMAL_GAP``); ``SearchError`` when there is none; ``Pruned`` when the LP relaxation's optimum (a lower
    bound of every plan) already reaches ``cutoff``.

    LP relaxation first; an integral LP optimum is optimal.  A fractional one is rounded (each
    variable's largest ``x``); when the rounded plan is within ``gap`` of the LP bound it is returned,
    else branch and bound runs for the time left, and the better of its plan and the rounded one wins.
    """
    t0 = time.perf_counter()
    name = "ilp-highs"
    if p.n == 0:
        return Solution([], 0.0, 0.0, "optimal", 0.0, name)
    run = _run
    f = formulate(p)
    status, values, bound = run(f, False, time_limit_s, gap, cutoff)
    if status == "infeasible":
        raise _infeasible(p, time_limit_s)
    if status == "cutoff":
        assert cutoff is not None
        raise Pruned(bound, cutoff)
    candidates = [f.choice(values)] if values is not None else []
    fits = [c for c in candidates if _fits(p, c)]
    lp_bound = bound if status == "optimal" else -float("inf")
    if cutoff is not None and lp_bound >= cutoff:
        raise Pruned(lp_bound, cutoff)
    if fits and status == "optimal" and relative_gap(p.evaluate(fits[0]), lp_bound) <= gap:
        return _best(p, fits, lp_bound, name, t0)
    left = time_limit_s - (time.perf_counter() - t0)
    if left > 0.1:
        status, values, bound = run(f, True, left, gap)
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
    return Solution(choice, obj, bound, status, time.perf_counter() - t0, name)


def relative_gap(objective: float, bound: float) -> float:
    """``(objective - bound) / |objective|``: how far a plan may be from optimal (0: proven optimal)."""
    if objective == bound:
        return 0.0
    return max(0.0, objective - bound) / abs(objective) if objective else float("inf")
