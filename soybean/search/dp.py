"""SoyBean's dynamic programme, exact on any graph: min-sum variable elimination.

SoyBean (arXiv 1805.04170) finds the best 2-way tiling by dynamic programming
over the dataflow graph.  Written as variable elimination it reads

    f_new(N(v)) = min_{s_v} [ c_v(s_v) + sum_{factors f containing v} f(s_v, N(v)) ]

eliminating variables in min-degree order; the cost is exponential only in the
graph's treewidth (chains and residual blocks: 1-3).  ``solve_dp`` is exact; a
table larger than ``max_table`` entries raises (use the ILP).
"""
from __future__ import annotations

import time

import numpy as np

from .ilp import Solution
from .problem import Problem


class _Factor:
    def __init__(self, vars_: tuple[int, ...], table: np.ndarray) -> None:
        self.vars, self.table = vars_, table


def _align(f: _Factor, scope: tuple[int, ...], sizes: dict[int, int]) -> np.ndarray:
    """Broadcast ``f.table`` to ``scope`` order (missing vars as size-1 axes)."""
    perm = [f.vars.index(v) for v in scope if v in f.vars]
    t = np.transpose(f.table, perm)
    shape = [sizes[v] if v in f.vars else 1 for v in scope]
    return t.reshape(shape)


def _scope_of(v: int, factors: list[_Factor]) -> set[int]:
    """The variables that share a factor with ``v``."""
    s: set[int] = set()
    for f in factors:
        if v in f.vars:
            s.update(f.vars)
    s.discard(v)
    return s


def solve_dp(p: Problem, *, max_table: int = 20_000_000) -> Solution:
    t0 = time.perf_counter()
    if p.budget is not None:
        raise ValueError("the DP does not take a memory budget: use --solver ilp")
    sizes = {v: len(u) for v, u in enumerate(p.unary)}
    factors: list[_Factor] = [_Factor((v,), np.asarray(u, dtype=float)) for v, u in enumerate(p.unary)]
    factors += [_Factor((u, v), np.asarray(C, dtype=float)) for (u, v), C in p.edges.items()]
    remaining = set(range(p.n))
    trail: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    const = 0.0
    while remaining:
        # min-degree: the variable whose elimination makes the smallest table
        _, v = min((int(np.prod([sizes[w] for w in _scope_of(x, factors)] or [1])), x) for x in remaining)
        rest = tuple(sorted(_scope_of(v, factors)))
        scope = (v,) + rest
        if int(np.prod([sizes[w] for w in scope])) > max_table:
            raise ValueError("graph too wide for the DP (table too large): use --solver ilp")
        mine = [f for f in factors if v in f.vars]
        factors = [f for f in factors if v not in f.vars]
        total = sum((_align(f, scope, sizes) for f in mine), np.zeros([sizes[w] for w in scope]))
        trail.append((v, rest, total.argmin(axis=0)))
        new = total.min(axis=0)
        if rest:
            factors.append(_Factor(rest, new))
        else:
            const += float(new)
        remaining.discard(v)
    choice = [-1] * p.n
    for v, rest, arg in reversed(trail):
        choice[v] = int(arg[tuple(choice[w] for w in rest)]) if rest else int(arg)
    obj = p.evaluate(choice)
    return Solution(choice, obj, obj, "optimal", time.perf_counter() - t0, "dp")
