"""Exact search as an integer linear programme (OR-Tools linear solver, HiGHS).

Variables: ``x[v,s] in {0,1}`` (variable ``v`` takes strategy ``s``) and, per edge
``(u,v)``, ``y[e,s,t] >= 0`` (the pair is chosen).

    (one strategy)      sum_s x[v,s] = 1                                  ``_choose_one``
    (edge marginals)    sum_t y[e,s,t] = x[u,s],  sum_s y[e,s,t] = x[v,t] ``_edges``
    (memory, optional)  sum_v sum_s m[v,s] x[v,s] <= M                    ``_memory``
    minimise            sum_v sum_s c[v,s] x[v,s] + sum_e sum_st C_e[s,t] y[e,s,t]

The marginal form (rather than ``y >= x_u + x_v - 1``) has an LP relaxation that
is exact on trees, so HiGHS usually proves optimality at the root.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

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


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send whatever native code writes to file descriptor 1 to stderr meanwhile: HiGHS prints its
    banner there even with output suppressed, which would corrupt ``soybean plan --format json``."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


_STATUS = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "feasible",
           pywraplp.Solver.INFEASIBLE: "infeasible"}


class _Builder:
    def __init__(self, p: Problem, backend: str) -> None:
        self.p = p
        self.s = pywraplp.Solver.CreateSolver(backend)
        if self.s is None:
            raise SearchError(f"OR-Tools has no {backend} backend in this build: use --solver dp")
        self.s.SuppressOutput()
        self.obj = self.s.Objective()
        self.x: list[list] = []

    def _choose_one(self) -> None:
        for v, c in enumerate(self.p.unary):
            xs = [self.s.BoolVar(f"x{v}_{k}") for k in range(len(c))]
            self.s.Add(sum(xs) == 1)
            for var, cost in zip(xs, c):
                if cost:
                    self.obj.SetCoefficient(var, float(cost))
            self.x.append(xs)

    def _edges(self) -> None:
        for (u, v), C in self.p.edges.items():
            if len(self.x[u]) == 1 or len(self.x[v]) == 1:
                # one side fixed: the edge is linear in the other side's choice
                if len(self.x[u]) == 1:
                    for t, var in enumerate(self.x[v]):
                        self.obj.SetCoefficient(var, self.obj.GetCoefficient(var) + float(C[0, t]))
                else:
                    for s_, var in enumerate(self.x[u]):
                        self.obj.SetCoefficient(var, self.obj.GetCoefficient(var) + float(C[s_, 0]))
                continue
            base = C.min()  # constant offset keeps the LP well scaled
            y = [[self.s.NumVar(0.0, 1.0, "") for _ in range(C.shape[1])] for _ in range(C.shape[0])]
            for s_ in range(C.shape[0]):
                self.s.Add(sum(y[s_]) == self.x[u][s_])
            for t in range(C.shape[1]):
                self.s.Add(sum(y[s_][t] for s_ in range(C.shape[0])) == self.x[v][t])
            for s_ in range(C.shape[0]):
                for t in range(C.shape[1]):
                    if C[s_, t] != base:
                        self.obj.SetCoefficient(y[s_][t], float(C[s_, t] - base))
            self.obj.SetOffset(self.obj.offset() + float(base))

    def _memory(self) -> None:
        if self.p.budget is None or self.p.memory is None:
            return
        used = sum(float(m) * var for v, ms in enumerate(self.p.memory) for m, var in zip(ms, self.x[v]) if m)
        self.s.Add(used <= float(self.p.budget))


def solve_ilp(p: Problem, *, backend: str = "HIGHS", time_limit_s: float = 60.0) -> Solution:
    """Optimal choice for ``p``, or the best found within ``time_limit_s`` (status ``feasible``, with
    the solver's bound); ``SearchError`` when there is none."""
    t0 = time.perf_counter()
    if p.n == 0:
        return Solution([], 0.0, 0.0, "optimal", 0.0, f"ilp-{backend.lower()}")
    b = _Builder(p, backend)
    b._choose_one()
    b._edges()
    b._memory()
    b.obj.SetMinimization()
    b.s.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    with stdout_to_stderr():
        status = b.s.Solve()
    name = _STATUS.get(status, "error")
    if name == "infeasible":
        raise SearchError("no plan satisfies the memory budget: raise it")
    if name not in ("optimal", "feasible"):
        raise SearchError(f"the ILP solver found no plan within {time_limit_s:g} s (status {status}): "
                          "give more time (--time-limit) or use --solver dp")
    choice = [int(np.argmax([var.solution_value() for var in xs])) for xs in b.x]
    obj = p.evaluate(choice)
    try:
        bound = b.obj.BestBound()
    except Exception:  # some backends have no bound
        bound = obj
    if name == "optimal":
        bound = min(bound, obj)
    return Solution(choice, obj, float(bound), name, time.perf_counter() - t0, f"ilp-{backend.lower()}")
