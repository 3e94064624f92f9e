"""SoyBean's recursive k-cuts: 2^k devices as k successive 2-way cuts.

Cut ``i`` bisects every tensor once more (mesh axis ``i`` of a ``(2,)*k`` mesh),
choosing the best one-cut tiling *given* cuts ``0..i-1`` and with the later
axes still replicated.  Per device, cut ``i`` moves tensors already halved
``i`` times; summed over the ``2^i`` groups that run it, that is SoyBean's
weighting of cut ``i`` by ``2^(i-1)`` in total bytes.  Each cut is solved
exactly (DP by default); the sequence is greedy, so the result can exceed the
joint optimum over all axes (measured in tests/test_search.py).

The cuts read of each strategy only what it does on each mesh axis (``Cuts``); ``planner.kcuts`` reads that from
a planning graph.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from . import solve
from .ilp import Solution
from .problem import Problem


@dataclass(frozen=True)
class Cuts:
    """What the cuts know of strategy ``s`` of variable ``v`` on mesh axis ``a``.

    ``placement[v][s][a]``: what cut ``a`` decides (its tensors' placements there); once axis ``a`` is cut, a
    variable keeps only the strategies placed as its chosen one.  ``replicated[v][s, a]``: ``s`` leaves axis ``a``
    alone (every tensor replicated there, no partial gradient), as each cut wants of the axes after it.
    ``divides[v][s, a]``: ``s`` splits its work on ``a``; a cut keeps only such strategies where any is left, for
    the variables whose entry is not ``None``."""

    placement: Sequence[Sequence[tuple[Hashable, ...]]]
    replicated: Sequence[np.ndarray]
    divides: Sequence[np.ndarray | None]


def greedy_cuts(full: Problem, cuts: Cuts, k: int, solver: str = "dp") -> Solution:
    """Greedy cut-by-cut plan of ``full`` on ``k`` axes of two: each axis's cut solved exactly (``solve`` with
    ``solver``) over the strategies left, then fixed."""
    allowed = [list(range(len(p))) for p in cuts.placement]
    chosen: list[int] = []
    for axis in range(k):
        doms = []
        for vi in range(full.n):
            later_r = [s for s in allowed[vi] if cuts.replicated[vi][s, axis + 1:].all()]
            dom = later_r or allowed[vi]
            divides = cuts.divides[vi]
            if divides is not None:
                dom = [s for s in dom if divides[s, axis]] or dom
            doms.append(dom)
        sub = Problem([full.unary[vi][d] for vi, d in enumerate(doms)], {}, None, None, full.names)
        for (u, w), C in full.edges.items():
            sub.add_edge(u, w, C[np.ix_(doms[u], doms[w])])
        sol = solve(sub, solver)
        chosen = [doms[vi][c] for vi, c in enumerate(sol.choice)]
        # fix this axis: keep strategies agreeing with the chosen one on axes <= axis
        for vi in range(full.n):
            key = cuts.placement[vi][chosen[vi]][axis]
            allowed[vi] = [s for s in allowed[vi] if cuts.placement[vi][s][axis] == key]
    choice = [a[0] if len(a) == 1 else chosen[vi] for vi, a in enumerate(allowed)]
    obj = full.evaluate(choice)
    return Solution(choice, obj, obj, "greedy", 0.0, f"kcuts-{solver}")
