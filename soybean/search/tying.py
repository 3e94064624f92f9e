"""Repeated-layer tying: isomorphic layers share one set of decision variables.

A transformer's decoder layers are the same subgraph N times: same ops, shapes, strategy lists,
costs, and parameter roles.  A ``Run`` names such layers, each a *block* of the problem's variables
(``planner.repeats.find_repeats`` finds them in a planning graph: consecutive isomorphic blocks).

``tie`` is the reduction: every variable of a run's later blocks is mapped onto the variable at the
same position of its first block; unary costs and memory add, edges are mapped and add (an edge
between consecutive blocks becomes one inside the tied block; an edge whose ends map to one
variable keeps its diagonal).  The tied problem's objective at a choice equals the untied
objective at the copied choice, so a tied plan is a plan of the exact problem, priced exactly.

When it can differ from the untied optimum: tying restricts every layer of a run to the same
strategies.  The first and last layers are not in the run (the first reads the embedding, the last
feeds the final norm, so their edges differ) and stay free; layers in between are each fed the
layer before's output in the same tiling, so the untied optimum is tied whenever the cheapest
per-layer cycle of interface tilings has period one (it does on every transformer we plan: the
residual stream keeps its tiling from layer to layer).  It can differ when alternating layers
would pay off (a tiling that flips each layer, cheaper in pairs), or when a layer is coupled to a
non-neighbour (a weight shared between layers, tied input/output embeddings) in ways whose cost
differs per layer -- such layers are not isomorphic by ``find_repeats``' test, and are left untied.  The
gap the solver reports is the tied problem's; ``plan(tie_layers=False)`` solves untied.

Not so under a memory budget: it couples the layers, and one tied decision moves every layer's memory at once,
so the tied optimum can lie well above plans that lay some layers out one way and the rest another (the
Lagrangian's bound still holds: each relaxed problem is unbudgeted).  ``mix_layers`` makes those plans from two
plans on either side of the budget; ``search.solve`` reports the Lagrangian's bound for a tied budgeted problem.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .problem import Problem


@dataclass(frozen=True)
class Run:
    """Consecutive isomorphic blocks of ``period`` layers each, layers ``first..last`` of ``prefix``:
    ``blocks[j][k]`` is the ``k``-th variable (graph order) of the ``j``-th block."""

    prefix: str
    first: int
    last: int
    blocks: tuple[tuple[int, ...], ...]
    period: int = 1  # layers per block: more than one where the stack alternates kinds of layer

    def record(self) -> dict[str, object]:
        """The plan JSON's row: the stack, its first and last layer tied, how many blocks, and (only where it is
        more than one) how many layers a block holds."""
        out: dict[str, object] = {"prefix": self.prefix, "layers": [self.first, self.last], "count": len(self.blocks)}
        if self.period > 1:
            out["period"] = self.period
        return out


def representatives(n: int, runs: Sequence[Run]) -> list[int]:
    """Each of ``n`` variables' representative under ``runs``: itself, or the variable at its position in the first
    block of its run."""
    rep = list(range(n))
    for r in runs:
        for blk in r.blocks[1:]:
            for k, v in enumerate(blk):
                rep[v] = r.blocks[0][k]
    return rep


def tied_map(n: int, runs: Sequence[Run]) -> tuple[list[int], int]:
    """``tie``'s map from each of ``n`` variables to its variable in the tied problem, and how many that has."""
    to, keep = _numbered(representatives(n, runs))
    return to, len(keep)


def _numbered(rep: list[int]) -> tuple[list[int], list[int]]:
    """Each variable's tied variable, the representatives numbered in order, and the representatives."""
    keep = sorted(set(rep))
    new = {v: i for i, v in enumerate(keep)}
    return [new[r] for r in rep], keep


def tie(p: Problem, runs: list[Run]) -> tuple[Problem, list[int]]:
    """``p`` with each run's blocks sharing the first block's variables, and the map from every
    variable of ``p`` to its variable in the tied problem."""
    rep = representatives(p.n, runs)
    to, keep = _numbered(rep)
    unary = [np.zeros_like(p.unary[v], dtype=float) for v in keep]
    memory = [np.zeros_like(p.memory[v], dtype=float) for v in keep] if p.memory is not None else None
    for v in range(p.n):
        unary[to[v]] += p.unary[v]
        if memory is not None and p.memory is not None:
            memory[to[v]] += p.memory[v]
    # A block all of whose variables stand for themselves stays a block (a run's first, an untied layer); the
    # blocks tied onto another are gone.
    blocks = tuple(tuple(to[v] for v in b) for b in p.blocks if all(rep[v] == v for v in b))
    q = Problem(unary, {}, memory, p.budget, [p.names[v] for v in keep] if p.names else [], blocks)
    for (u, v), C in p.edges.items():
        q.add_edge(to[u], to[v], C)
    return q, to


def cut_sides(n: int, runs: Sequence[Run]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Every mix of two plans of ``n`` variables cut inside one run of ``runs``: per mix, which plan each variable
    takes (``[mixes, n]``, 0 or 1): blocks ``k..`` of run ``i`` from one, everything else from the other, for every
    run, every ``k >= 1`` and both orders; and each mix's ``(i, k, first)``, ``first`` the plan everything but the
    tail takes.  (``mix_layers`` and the capped overlap's ``planner.mix.mixes`` price them.)"""
    sides: list[np.ndarray] = []
    cuts: list[tuple[int, int, int]] = []
    for i, run in enumerate(runs):
        for k in range(1, len(run.blocks)):
            tail = [v for blk in run.blocks[k:] for v in blk]
            for first in (0, 1):
                side = np.full(n, first, dtype=np.int64)
                side[tail] = 1 - first
                sides.append(side)
                cuts.append((i, k, first))
    return (np.stack(sides) if sides else np.zeros((0, n), dtype=np.int64)), cuts


# Relative slack of the budget test of a mix: its memory summed in another order than ``Problem.memory_of``'s.
MIX_SLACK = 1e-12


def mix_layers(p: Problem, beyond: Sequence[int], within: Sequence[int],
               runs: Sequence[Run]) -> tuple[list[int], float] | None:
    """The cheapest plan of ``p`` within its budget that mixes plans ``beyond`` (over the budget) and ``within``
    layer by layer: a run's blocks ``0..k-1`` from one, the rest of that run from the other, every other variable
    from the first (both orders, every run, every ``k``), as ``(choice, value)``; None when no mix fits, or the
    plans are equal.  ``alike`` says which layers it still lays out alike.

    Why it closes a duality gap: the Lagrangian's plans on either side of its peak ``lam*`` lie on one line
    ``cost + lam* (mem - M) = D(lam*)``, the dual's best bound.  Cost and memory are sums over variables and edges,
    so a mix moves both by one block's share per step of ``k`` (apart from the two edges at the cut), along that
    line: the mix that just fits costs within about one block's share of ``D(lam*)``, where the tied problem's
    plans may be a whole tied decision (times every layer) away.  Every mix is priced exactly, over arrays."""
    assert p.memory is not None and p.budget is not None
    a, b = np.asarray(beyond, dtype=np.int64), np.asarray(within, dtype=np.int64)
    if np.array_equal(a, b):
        return None
    n = p.n
    side, _ = cut_sides(n, runs)  # [mixes, variables]: 0 takes ``beyond``'s strategy, 1 ``within``'s
    if len(side) == 0:
        return None
    cols = np.arange(n)[None, :]
    xs = (a, b)
    unary = np.array([[float(p.unary[v][x[v]]) for v in range(n)] for x in xs])
    memory = np.array([[float(p.memory[v][x[v]]) for v in range(n)] for x in xs])
    cost = unary[side, cols].sum(axis=1)
    mem = memory[side, cols].sum(axis=1)
    if p.edges:
        ends = np.array(list(p.edges), dtype=np.int64)
        pair = np.array([[float(C[xs[s][u], xs[t][v]]) for (u, v), C in p.edges.items()]
                         for s in (0, 1) for t in (0, 1)])  # [2 s + t, edge]
        cost = cost + pair[2 * side[:, ends[:, 0]] + side[:, ends[:, 1]], np.arange(len(ends))[None, :]].sum(axis=1)
    fits = np.flatnonzero(mem <= float(p.budget) * (1 + MIX_SLACK))
    if len(fits) == 0:
        return None
    m = int(fits[np.argmin(cost[fits])])
    choice = np.where(side[m] == 1, b, a).tolist()
    if p.memory_of(choice) > float(p.budget):
        return None  # within the slack only: not a plan of the budget as ``Problem`` prices it
    return choice, p.evaluate(choice)


def alike(runs: Sequence[Run], choice: Sequence[int]) -> list[Run]:
    """``runs`` split where ``choice`` lays a block out unlike the one before it: the stretches of at least two
    blocks laid out alike, each a run (a plan that ties every run gives ``runs`` back)."""
    out: list[Run] = []
    for run in runs:
        start = 0
        for k in range(1, len(run.blocks) + 1):
            if k < len(run.blocks) and [choice[v] for v in run.blocks[k]] == [choice[v] for v in run.blocks[k - 1]]:
                continue
            if k - start > 1:
                out.append(Run(run.prefix, run.first + start * run.period, run.first + k * run.period - 1,
                               run.blocks[start:k], run.period) if (start, k) != (0, len(run.blocks)) else run)
            start = k
    return out
