"""SoyBean's recursive k-cuts: 2^k devices as k successive 2-way cuts.

Cut ``i`` bisects every tensor once more (mesh axis ``i`` of a ``(2,)*k`` mesh),
choosing the best one-cut tiling *given* cuts ``0..i-1`` and with the later
axes still replicated.  Per device, cut ``i`` moves tensors already halved
``i`` times; summed over the ``2^i`` groups that run it, that is SoyBean's
weighting of cut ``i`` by ``2^(i-1)`` in total bytes.  Each cut is solved
exactly (DP by default); the sequence is greedy, so the result can exceed the
joint optimum over all axes (measured in tests/test_search.py).
"""
from __future__ import annotations

import numpy as np

from ..capture.core import Captured
from ..cost.profiles import Profile
from ..graph import build
from ..mesh import Mesh
from ..tiling import Replicate
from . import solve, to_problem
from .ilp import Solution
from .problem import Problem


def _placement_key(v, s_idx: int, axis: int) -> tuple:
    st = v.strategies[s_idx]
    flags = v.grad_partial[s_idx] if v.grad_partial else ()
    return (tuple(t[axis] for t in st.inputs), tuple(t[axis] for t in st.outputs), axis in flags)


def kcuts(cap: Captured, k: int, profile: Profile, objective: str = "comm", solver: str = "dp") -> tuple:
    """Greedy cut-by-cut plan on the ``(2,)*k`` mesh; returns ``(graph, Solution)``."""
    mesh = Mesh((2,) * k)
    g = build(cap, mesh, profile, objective="time")  # no split-every-axis filter: cuts apply it per axis
    full = to_problem(g, objective)
    allowed = [list(range(len(v.strategies))) for v in g.vars]
    for axis in range(k):
        doms = []
        for vi, v in enumerate(g.vars):
            later = range(axis + 1, k)
            later_r = [s for s in allowed[vi]
                       if all(isinstance(t[a], Replicate)
                              for t in v.strategies[s].inputs + v.strategies[s].outputs for a in later)
                       and not any(a in (v.grad_partial[s] if v.grad_partial else ()) for a in later)]
            dom = later_r or allowed[vi]
            if objective == "comm" and v.kind == "op":
                split = [s for s in dom if v.strategies[s].divides_work()[axis]]
                dom = split or dom
            doms.append(dom)
        sub = Problem([full.unary[vi][d] for vi, d in enumerate(doms)], {}, None, None, full.names)
        for (u, w), C in full.edges.items():
            sub.add_edge(u, w, C[np.ix_(doms[u], doms[w])])
        sol = solve(sub, solver)
        chosen = [doms[vi][c] for vi, c in enumerate(sol.choice)]
        # fix this axis: keep strategies agreeing with the chosen one on axes <= axis
        for vi, v in enumerate(g.vars):
            key = _placement_key(v, chosen[vi], axis)
            allowed[vi] = [s for s in allowed[vi] if _placement_key(v, s, axis) == key]
    choice = [a[0] if len(a) == 1 else chosen[vi] for vi, a in enumerate(allowed)]
    obj = full.evaluate(choice)
    return g, Solution(choice, obj, obj, "greedy", 0.0, f"kcuts-{solver}")
