"""Plans mixed layer by layer: the capped overlap's plans between the dual's two sides.

The step time under the capped overlap is ``T(x) = L(x) - min(o S(x), b K(x))`` (``solve.evaluate``), and
``solve.capped_overlap`` bounds it by the Lagrangian members ``T_mu = L - (1 - mu) o S - mu b K``.  Each member's
optimum is a vertex of the plans' hull, so the dual's peak ``D(mu*)`` is met by two plans on either side of the
cap, ``A`` hiding less than it is credited with (``o S > b K``) and ``B`` the other way; the plans in between,
which balance the two sides (``o S = b K``), are no member's optimum, and the gap left is the duality gap.

A stack of repeated layers makes those plans: take blocks ``0..k-1`` of a run from one plan and the rest from the
other.  ``L``, ``S`` and ``K`` are sums over variables and edges, so apart from the two edges at the cut they move
by one block's share per step of ``k``; at ``mu*`` both plans' lines meet, so every mix lies on ``T_{mu*} =
D(mu*)`` up to the cut's edges, and the mix where ``o S`` crosses ``b K`` has ``T`` within one block's share (and
the cut's reshard) of the dual's peak, the best bound.  Every mix is a plan of the same table (recomputation and
tiling change costs, not domains), priced exactly by ``evaluate``: a mix never changes a bound, only the best plan.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..graph import PlanGraph
from ..search import Solution
from ..search.tying import Run, cut_sides

# Mixes priced exactly (``evaluate``) after the cheap sums ranked them: the sums are exact too, so the first that
# fits the budget is the answer; the rest cover a memory budget the best mixes break.
EXACT_TRIES = 4


def mixes(g: PlanGraph, a: Sequence[int], b: Sequence[int], runs: Sequence[Run],
          overlap_share: float) -> list[tuple[float, list[int], list[Run]]]:
    """Every mix of plans ``a`` and ``b`` of ``g`` cut inside one run of ``runs``: blocks before the cut from one
    plan, the rest of that run from the other, every other variable from the first (both orders), as
    ``(T, choice, runs)``, cheapest ``T`` first.  ``T`` is ``evaluate``'s step time, summed over arrays:
    ``sum seconds + sum compute - min(o * sync, overlap_share * op compute)``; the runs are the run split at the cut
    (each part still laid out alike).  Empty when the plans are equal or no run has two blocks."""
    ca, cb = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if np.array_equal(ca, cb):
        return []
    n, o = len(g.vars), g.profile.grad_overlap
    # Per variable, under each plan: compute (with an op's own communication, as the search counts it), and the
    # op compute the cap is measured on.
    comp = np.array([[float(v.compute_s[c]) for v, c in zip(g.vars, x)] for x in (ca, cb)])
    inside = np.array([[float(v.op_comm[c, 1]) if v.op_comm is not None else 0.0 for v, c in zip(g.vars, x)]
                       for x in (ca, cb)])
    is_op = np.array([v.kind == "op" for v in g.vars])
    op_comp = (comp - inside) * is_op
    # Per edge, under each pair of sides (0: from ``a``, 1: from ``b``) of its two ends: seconds and sync.
    src = np.array([e.src for e in g.edges], dtype=np.int64)
    dst = np.array([e.dst for e in g.edges], dtype=np.int64)
    xs = (ca, cb)
    secs = np.array([[float(e.seconds[xs[p][e.src], xs[q][e.dst]]) for e in g.edges]
                     for p in (0, 1) for q in (0, 1)])
    sync = np.array([[float(e.sync[xs[p][e.src], xs[q][e.dst]]) if e.sync is not None else 0.0 for e in g.edges]
                     for p in (0, 1) for q in (0, 1)])
    side, cuts = cut_sides(n, runs)  # [mixes, vars]: the rest of the graph from the plan ``first``
    if not cuts:
        return []

    def split(i: int, k: int) -> list[Run]:
        """``runs`` with run ``i`` split at block ``k`` (each part of at least two blocks kept)."""
        run = runs[i]
        parts = [Run(run.prefix, run.first, run.first + k * run.period - 1, run.blocks[:k], run.period),
                 Run(run.prefix, run.first + k * run.period, run.last, run.blocks[k:], run.period)]
        return [r for j, r in enumerate(runs) if j != i] + [r for r in parts if len(r.blocks) > 1]

    cols = np.arange(n)[None, :]
    var_comp = comp[side, cols].sum(axis=1)
    var_op = op_comp[side, cols].sum(axis=1)
    combo = 2 * side[:, src] + side[:, dst]  # [mixes, edges]
    edge_cols = np.arange(len(src))[None, :]
    edge_s = secs[combo, edge_cols].sum(axis=1)
    edge_sync = sync[combo, edge_cols].sum(axis=1)
    t = edge_s + var_comp - np.minimum(o * edge_sync, overlap_share * var_op)
    order = np.argsort(t, kind="stable")
    out = []
    for m in order.tolist():
        if not math.isfinite(float(t[m])):
            break
        out.append((float(t[m]), np.where(side[m] == 1, cb, ca).tolist(), split(*cuts[m][:2])))
    return out


def mixed(sol: Solution, choice: list[int]) -> Solution:
    """``sol``'s record for the mix ``choice`` of its plan and another: its solver's name marked ``+mixed``
    (found by mixing, not by that solve); objective, bound and status are ``capped_overlap``'s to set."""
    return Solution(choice, sol.objective, sol.bound, sol.status, sol.seconds, sol.solver + "+mixed")
