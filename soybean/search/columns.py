"""The LP relaxation of a large core by column generation, exact to a proven bound.

A Llama-3-8B 3-D core has ~1.4 million pair columns, of which the LP optimum uses a few thousand.  The
restricted LP holds every ``x`` column and a few ``y`` columns per edge: the pairs of a starting plan (so it
is feasible), each row class's and each column class's cheapest pair, and the columns a hint names (the last
solve of a problem of the same shape: the planner solves the members of ``capped_overlap`` and the mesh
shapes one after another, and their optima share most columns).  Each round solves it (dual simplex, warm
after the first) and prices every column from its duals ``pi``: ``rc = c - A^T pi``.  Each edge's
cheapest negative column per row class and per column class joins, and the rounds stop when none is
negative (the restricted optimum is the LP optimum) or when the restricted objective is within ``tol`` of the
Lagrangian bound

    L(pi) = pi . b + offset + sum_v min_s rc[x_vs] + sum_e min_rc rc[y_erc]

(every row relaxed with multiplier ``pi``, ``pi <= 0`` on the memory row; each variable's ``x`` and each
edge's ``y`` kept on their simplex, which every feasible point satisfies: ``formulation``).  ``L`` is a lower
bound of the LP optimum for any ``pi``, so a caller's cutoff prunes as soon as it reaches it, and the
bound returned is always proven.  On that core: 2.5 s for the whole LP, ~2 s cold by columns, ~1 s from the
previous member's columns.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from time import perf_counter

import numpy as np

from .formulation import Formulation
from .highs import lp_model, run
from .problem import Problem

# Cores with fewer pair columns are solved whole: one LP is then faster than the rounds.
COLUMNS_MIN = 200_000
# A column whose reduced cost is below this (seconds per unit) joins: HiGHS's own optimality tolerance is 1e-7.
NEGATIVE = -1e-9
MAX_ROUNDS = 200
# Hints kept, one per problem shape (cores of the last few mesh shapes solved).
HINTS_KEPT = 4


@dataclass
class Hint:
    """The columns and plan of a problem's last solve: per edge, its pair columns as strategy pairs ``(s, t)``
    (a class's representative), which name the same pairs in any problem of the same shape."""

    pairs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]
    choice: list[int]


class Hints:
    """The last solve's columns of each problem shape (at most ``HINTS_KEPT``, the most recent), kept by the caller
    for one planner run (``planner.solve.PlannerRun``): the members of ``capped_overlap`` and the mesh shapes it
    solves one after another share most columns.  Filled by ``solve_by_columns``."""

    def __init__(self) -> None:
        self._by_shape: OrderedDict[tuple, Hint] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_shape)

    def get(self, p: Problem) -> Hint | None:
        """The hint of a problem of ``p``'s shape, if one was solved."""
        return self._by_shape.get(_shape(p))

    def store(self, p: Problem, hint: Hint) -> None:
        """Keep ``hint`` for ``p``'s shape, forgetting the oldest shape beyond ``HINTS_KEPT``."""
        key = _shape(p)
        self._by_shape[key] = hint
        self._by_shape.move_to_end(key)
        while len(self._by_shape) > HINTS_KEPT:
            self._by_shape.popitem(last=False)


def _shape(p: Problem) -> tuple:
    return tuple(len(c) for c in p.unary), tuple(p.edges)


def _start_choice(p: Problem) -> list[int]:
    """A plan to start from: each variable's least memory (ties: cheapest) under a budget, so the restricted
    LP is feasible whenever the problem is; else each variable's cheapest."""
    if p.budget is not None and p.memory is not None:
        return [int(np.lexsort((c, m))[0]) for c, m in zip(p.unary, p.memory)]
    return [int(np.argmin(c)) for c in p.unary]


def _first_columns(f: Formulation, choice: list[int], hint: Hint | None) -> np.ndarray:
    cols = [np.arange(int(f.x_start[-1]))]
    for b in f.blocks:
        K = f.cost[b.start:b.start + b.rows * b.cols].reshape(b.rows, b.cols)
        u, v = b.edge
        cols.append(b.start + np.arange(b.rows) * b.cols + K.argmin(axis=1))
        cols.append(b.start + K.argmin(axis=0) * b.cols + np.arange(b.cols))
        cols.append(np.array([b.start + b.ri[choice[u]] * b.cols + b.ci[choice[v]]]))
        if hint is not None and b.edge in hint.pairs:
            s, t = hint.pairs[b.edge]
            cols.append(b.start + b.ri[s] * b.cols + b.ci[t])
    return np.unique(np.concatenate(cols))


def _entering(f: Formulation, rc: np.ndarray, have: np.ndarray) -> np.ndarray:
    """Each edge's most negative column per row class and per column class, not yet in."""
    add = []
    for b in f.blocks:
        R = rc[b.start:b.start + b.rows * b.cols].reshape(b.rows, b.cols)
        r = R.argmin(axis=1)
        ok = R[np.arange(b.rows), r] < NEGATIVE
        add.append(b.start + np.flatnonzero(ok) * b.cols + r[ok])
        c = R.argmin(axis=0)
        ok = R[c, np.arange(b.cols)] < NEGATIVE
        add.append(b.start + c[ok] * b.cols + np.flatnonzero(ok))
    out = np.unique(np.concatenate(add)) if add else np.zeros(0, dtype=np.int64)
    return out[~have[out]]


def lagrangian_bound(f: Formulation, dual: np.ndarray, rc: np.ndarray) -> float:
    """``L(pi)`` of the module docstring (``dual`` already signed for the inequality rows)."""
    b = np.where(np.isfinite(f.row_lo), f.row_lo, f.row_hi)
    nx = int(f.x_start[-1])
    bound = float(dual @ b) + f.offset + float(np.minimum.reduceat(rc[:nx], f.x_start[:-1]).sum())
    if f.blocks:
        bound += float(np.minimum.reduceat(rc, np.array([b.start for b in f.blocks])).sum())
    return bound


def _hint(f: Formulation, have: np.ndarray, choice: list[int]) -> Hint:
    """The columns ``have`` of ``f`` and its plan ``choice``, as a hint for a problem of the same shape."""
    pairs = {}
    for b in f.blocks:
        r, c = np.divmod(np.flatnonzero(have[b.start:b.start + b.rows * b.cols]), b.cols)
        rep_r, rep_c = np.empty(b.rows, dtype=np.int64), np.empty(b.cols, dtype=np.int64)
        rep_r[b.ri], rep_c[b.ci] = np.arange(len(b.ri)), np.arange(len(b.ci))
        pairs[b.edge] = (rep_r[r], rep_c[c])
    return Hint(pairs, choice)


def solve_by_columns(p: Problem, f: Formulation, time_limit_s: float, tol: float,
                     cutoff: float | None = None, hints: Hints | None = None
                     ) -> tuple[str, np.ndarray | None, float] | None:
    """``f``'s LP relaxation as ``highs.solve_formulation`` reports it: (``optimal``, values, proven bound),
    (``cutoff``, None, bound) once ``L`` reaches ``cutoff``, or (``time_limit``, values, -inf); ``None`` when the
    restricted LP fails (the caller then solves it whole).  ``hints``: the caller's, read for a start and given
    this solve's columns (None: none kept)."""
    import highspy

    t0 = perf_counter()
    A = f.matrix()
    AT = A.T.tocsr()
    le = np.isneginf(f.row_lo)  # the memory row: its multiplier is <= 0
    hint = hints.get(p) if hints is not None else None
    choice = hint.choice if hint is not None else _start_choice(p)
    have = np.zeros(f.num_col, dtype=bool)
    have[_first_columns(f, choice, hint)] = True
    h = lp_model(f, A, np.flatnonzero(have), time_limit_s=time_limit_s)
    order = np.flatnonzero(have)  # the restricted LP's columns, in its own order
    for _ in range(MAX_ROUNDS):
        h.setOptionValue("time_limit", max(0.1, time_limit_s - (perf_counter() - t0)))
        run(h)
        st = h.getModelStatus()
        if st != highspy.HighsModelStatus.kOptimal:
            if st == highspy.HighsModelStatus.kTimeLimit and h.getInfo().primal_solution_status == 2:
                values = np.zeros(f.num_col)
                values[order] = np.asarray(h.getSolution().col_value)
                return "time_limit", values, -float("inf")
            return None
        sol = h.getSolution()
        dual = np.asarray(sol.row_dual, dtype=float)
        dual[le] = np.minimum(dual[le], 0.0)
        rc = f.cost - AT @ dual
        obj = float(h.getInfo().objective_function_value)
        bound = lagrangian_bound(f, dual, rc)
        if cutoff is not None and bound >= cutoff:
            return "cutoff", None, bound
        add = _entering(f, rc, have)
        done = len(add) == 0 or obj - bound <= tol * abs(obj)
        if done or perf_counter() - t0 > time_limit_s:
            values = np.zeros(f.num_col)
            values[order] = np.asarray(sol.col_value)
            if hints is not None:
                hints.store(p, _hint(f, have, f.choice(values)))
            if not done:
                return "time_limit", values, -float("inf")
            return "optimal", values, min(obj, bound)
        sub = A[:, add]
        h.addCols(len(add), f.cost[add], np.zeros(len(add)), np.ones(len(add)), sub.nnz,
                  sub.indptr[:-1].astype(np.int32), sub.indices.astype(np.int32), sub.data)
        have[add] = True
        order = np.concatenate([order, add])
    return None
