"""HiGHS through ``highspy``: a formulation's arrays handed over whole, one thread per process.

``solve_formulation`` solves a whole ``Formulation`` (as an LP, or with integral ``x``); ``lp_model`` builds
the ``Highs`` object for any column subset (``columns``).  HiGHS prints its banner on file descriptor 1 even
with output suppressed (``native_stdout_silenced``), and a process forked after its parent ran HiGHS needs a
fresh thread scheduler (``fresh_scheduler``, which the planner's workers call as they start).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .formulation import Formulation


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


def fresh_scheduler() -> None:
    """HiGHS's thread scheduler made anew: call it first in a process forked from one that may have run HiGHS (a
    planner worker: ``planner.mesh_pool``).  A fork copies the scheduler's state but not its threads, and branch and
    bound then waits for threads that do not exist.  Nothing to do when this process has not loaded ``highspy``
    (its parent never ran HiGHS, so a scheduler made here starts fresh)."""
    highspy = sys.modules.get("highspy")
    if highspy is not None:
        highspy.Highs.resetGlobalScheduler(True)


def lp_model(f: Formulation, A: Any, cols: np.ndarray | None = None, integer: bool = False,
             time_limit_s: float = 60.0) -> Any:
    """A ``highspy.Highs`` holding ``f`` restricted to columns ``cols`` (all when ``None``) of its matrix
    ``A`` (``Formulation.matrix``), silent, one thread, within ``time_limit_s``.  As an LP it runs without
    presolve: HiGHS's presolve costs these tables more than it saves (a Llama-3-8B 2x2x2 core of 739k
    columns: 4.5 s with it, 1.6 s without); branch and bound (``integer``: the ``x`` columns integral) keeps it."""
    import highspy

    sub = A if cols is None else A[:, cols]
    n = sub.shape[1]
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, f.num_row
    lp.col_cost_, lp.offset_ = f.cost if cols is None else f.cost[cols], f.offset
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
    lp.row_lower_, lp.row_upper_ = f.row_lo, f.row_hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = sub.indptr, sub.indices, sub.data
    if integer:
        nx = int(f.x_start[-1])  # the x columns are integral, the pair columns continuous
        lp.integrality_ = [highspy.HighsVarType.kInteger] * nx + [highspy.HighsVarType.kContinuous] * (n - nx)
    with native_stdout_silenced():  # the banner is printed when the object is made
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)  # one per process: the planner runs one process per core (``mesh_pool``)
        h.setOptionValue("time_limit", max(0.1, float(time_limit_s)))
        if not integer:
            h.setOptionValue("presolve", "off")
        h.passModel(lp)
    return h


def run(h: Any) -> None:
    """``h.run()`` with the native banner kept off stdout."""
    with native_stdout_silenced():
        h.run()


def solve_formulation(f: Formulation, integer: bool, time_limit_s: float, gap: float,
                      cutoff: float | None = None, start: list[int] | None = None
                      ) -> tuple[str, np.ndarray | None, float]:
    """Solve ``f`` (as an LP, or with integral ``x``) with HiGHS: (status, column values, proven bound).
    ``cutoff`` (the LP only): the dual simplex stops as soon as its objective, a lower bound at every iteration,
    reaches it (HiGHS's ``objective_bound``), status ``cutoff`` with the cutoff as the bound: the problem cannot
    beat the plan the cutoff came from (half an LP solve on a Llama-3-8B 3-D core that the incumbent prunes).
    ``start`` (the ILP only): a plan branch and bound starts from as its incumbent, so it prunes from the first node
    (GPT-2's 3-D core: 4-16 s a solve without one)."""
    import highspy

    h = lp_model(f, f.matrix(), integer=integer, time_limit_s=time_limit_s)
    if integer:
        h.setOptionValue("mip_rel_gap", float(gap))
        if start is not None:
            given = highspy.HighsSolution()
            given.col_value = f.values_of(start).tolist()
            given.value_valid = True
            h.setSolution(given)
    elif cutoff is not None:
        h.setOptionValue("objective_bound", float(cutoff))
    run(h)
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
