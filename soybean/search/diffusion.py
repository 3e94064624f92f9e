"""A lower bound of a reduced problem in milliseconds: min-sum diffusion on its core.

Any *reparametrisation* of the core -- moving cost between a variable and an edge at it,

    theta_e(s, t) += lambda(s),   theta_u(s) -= lambda(s)      (likewise at the edge's other end),

leaves every plan's cost unchanged, so for every one

    OPT(core)  >=  sum_v min_s theta_v(s)  +  sum_e min_{s,t} theta_e(s, t)

(weak duality: these are the dual points of the LP relaxation ``ilp`` solves).  ``problem.lower_bound`` is the
bound at the trivial reparametrisation with each edge's row minima moved to one end.  Diffusion improves it by
star updates: at variable ``v`` every incident edge's min-marginal on ``v`` is moved into ``theta_v``, and the sum
is shared equally among ``v`` and those edges.  That update is the best choice of the messages into ``v`` with the
rest held (block coordinate ascent: the star's part of the bound becomes ``min_s theta_v(s)`` of the sum, never
less than before), so the bound never falls.  Its fixed points need not be the LP optimum (on some cores it stalls
well below it), so the planner uses it only to prune: a mesh whose bound reaches the best plan found elsewhere is
not solved (Llama-3-8B on 1,024 devices: a 16x16x4 core of 1.4 million pair costs passes the 8x16x8 optimum in
two sweeps, ~20 ms, where the LP took ~1.5 s).
"""
from __future__ import annotations

import numpy as np

from .problem import Problem, Reduced, isolated

# Sweeps at most, and the least relative gain of a sweep that is worth another.
SWEEPS = 12
STALL = 1e-4


def diffusion_bound(red: Reduced, p: Problem, target: float | None = None, sweeps: int = SWEEPS) -> float:
    """A lower bound of the optimum of ``p``, reduced to ``red``, by up to ``sweeps`` sweeps of star updates on the
    core; it stops once the bound reaches ``target`` or a sweep gains less than ``STALL`` of it."""
    core, p_isolated = red.core, isolated(red)
    unary = [np.asarray(u, dtype=float) for u in core.unary]
    edges = {}
    at: list[list[tuple[tuple[int, int], int]]] = [[] for _ in range(core.n)]
    for (u, v), C in core.edges.items():  # start where ``lower_bound`` stands: row minima moved to the lower end
        phi = C.min(axis=1)
        unary[u] = unary[u] + phi
        edges[(u, v)] = C - phi[:, None]
        at[u].append(((u, v), 1))  # the axis to minimise over for a marginal on u
        at[v].append(((u, v), 0))

    def bound() -> float:
        return p_isolated + sum(float(t.min()) for t in unary) + sum(float(C.min()) for C in edges.values() if C.size)

    best = bound()
    for _ in range(sweeps):
        for v in range(core.n):
            if not at[v]:
                continue
            total = unary[v]
            marginals = []
            for key, axis in at[v]:
                phi = edges[key].min(axis=axis)
                marginals.append(phi)
                total = total + phi
            share = total / (len(at[v]) + 1)
            unary[v] = share
            for (key, axis), phi in zip(at[v], marginals):
                delta = share - phi  # the edge gives up its marginal and takes its share
                edges[key] = edges[key] + (delta[:, None] if axis == 1 else delta[None, :])
        now = bound()
        gained, best = now - best, max(best, now)
        if (target is not None and best >= target) or gained <= STALL * abs(best):
            break
    return best
