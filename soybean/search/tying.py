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
