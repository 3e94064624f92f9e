"""Exhaustive enumeration: the reference the exact solvers are tested against."""
from __future__ import annotations

import itertools

from .problem import Problem


def brute_force(p: Problem, limit: int = 2_000_000) -> tuple[list[int], float]:
    """Minimum over every combination of choices (feasible under the memory budget)."""
    total = 1
    for u in p.unary:
        total *= len(u)
    if total > limit:
        raise ValueError(f"{total} combinations: too many for brute force")
    best, best_c = None, float("inf")
    for combo in itertools.product(*(range(len(u)) for u in p.unary)):
        if p.budget is not None and p.memory_of(list(combo)) > p.budget:
            continue
        c = p.evaluate(list(combo))
        if c < best_c - 1e-12:
            best, best_c = list(combo), c
    if best is None:
        raise ValueError("no plan fits the memory budget")
    return best, best_c
