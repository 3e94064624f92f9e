"""Exhaustive enumeration: the reference the exact solvers are tested against.

The cost of every combination is built as one broadcast array per value of the
first variable (numpy does the enumeration), so tens of millions of
combinations take seconds.
"""
from __future__ import annotations

import numpy as np

from .problem import Problem


def brute_force(p: Problem, limit: int = 200_000_000) -> tuple[list[int], float]:
    """Minimum over every combination of choices (feasible under the memory budget)."""
    sizes = [len(u) for u in p.unary]
    if int(np.prod(sizes, dtype=float)) > limit:
        raise ValueError(f"{int(np.prod(sizes, dtype=float))} combinations: too many for brute force")
    n = p.n
    if n == 0:
        return [], 0.0

    def axis_view(arr: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        shape = [1] * (n - 1)
        for a, s in zip(axes, arr.shape):
            shape[a - 1] = s
        return arr.reshape(shape)

    best, best_c = None, float("inf")
    for s0 in range(sizes[0]):
        total = np.zeros(sizes[1:]) + float(p.unary[0][s0])
        mem = np.zeros(sizes[1:]) + (float(p.memory[0][s0]) if p.memory is not None else 0.0)
        for v in range(1, n):
            total = total + axis_view(np.asarray(p.unary[v], float), (v,))
            if p.memory is not None:
                mem = mem + axis_view(np.asarray(p.memory[v], float), (v,))
        for (u, v), C in p.edges.items():
            total = total + (axis_view(C[s0], (v,)) if u == 0 else axis_view(C, (u, v)))
        if p.budget is not None:
            total = np.where(mem <= p.budget + 1e-12, total, np.inf)
        if total.size == 0:
            continue
        idx = int(np.argmin(total))
        c = float(total.flat[idx])
        if c < best_c - 1e-12:
            best_c = c
            best = [s0] + (list(np.unravel_index(idx, total.shape)) if n > 1 else [])
    if best is None or best_c == float("inf"):
        raise ValueError("no plan fits the memory budget")
    return [int(x) for x in best], best_c
