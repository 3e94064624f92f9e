"""The planning graph as the search's input: a table's ``Problem`` under an objective (``to_problem``) and a
recomputation choice's Lagrangian dual (``chain_dual``).

``soybean.search`` works on a ``Problem`` alone (unary and pairwise costs, memory, a budget); this module, with
``repeats`` (the table's repeated layers), is where a ``PlanGraph`` is read for it, so no solver imports the graph.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..graph import PlanGraph, budget_memory, phase_memory
from ..options import OBJECTIVES
from ..search import Problem, Run
from ..search.chain import Dual, dual
from ..search.diffusion import diffusion_bound
from ..search.problem import lower_bound, reduce_tied
from ..search.tying import tied_map
from .repeats import block_of


def to_problem(g: PlanGraph, objective: str, memory_budget: float | None = None,
               overlap: float | None = None, phase: str = "activations", compute_credit: float = 0.0) -> Problem:
    """Unary and pairwise costs of ``g`` under ``objective``.

    ``comm``: bytes sent per device per training step; step seconds are added
    with weight 1 byte/s only to break exact ties towards the faster plan.
    ``time``: modelled seconds, communication + compute, where a fraction
    ``overlap`` (default: the profile's ``grad_overlap``) of every deferred gradient
    all-reduce is taken as hidden behind backward: ``C = seconds - overlap * sync``.
    This linear discount is exact while the hidden time stays below the backward
    compute, the cap ``planner.evaluate`` applies; ``compute_credit`` ``c`` also takes ``c`` times each op's
    compute (its ``compute_s`` less its communication inside) off its cost: with ``overlap = (1 - mu) o`` and
    ``c = mu b`` this is the Lagrangian member ``mu`` of the capped objective (``planner.capped_overlap``).
    ``phase``: the memory the budget constrains: ``activations``, the activations phase less the rerun buffers
    (``graph.budget_memory``), a relaxation of the modelled peak whose plan the caller checks against the peak and
    the gradients phase; ``credited``, the activations phase less the ``rerun_credit`` every plan's rerun frees, a
    restriction of it (its plans' activations fit; the gradients phase is checked); or ``sum``, both phases at once
    less that credit, a restriction of both: every plan of it fits.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: use comm or time")
    unary = [v.compute_s.astype(float) for v in g.vars]  # a copy: the credit below is taken in place
    if compute_credit and objective == "time":
        for u, v in zip(unary, g.vars):
            if v.kind == "op":
                u -= compute_credit * (u - (v.op_comm[:, 1] if v.op_comm is not None else 0.0))
    memory, budget = None, None
    if memory_budget and phase == "activations":  # a relaxation of the peak: each variable less its rerun buffer
        memory, budget = [budget_memory(v) for v in g.vars], memory_budget
    elif memory_budget:  # a restriction: a plan's peak is at most its variables' memory less ``g.rerun_credit``
        memory = [phase_memory(v, "activations" if phase == "credited" else phase) for v in g.vars]
        budget = memory_budget + g.rerun_credit
    p = Problem(unary, {}, memory, budget, [v.name for v in g.vars], layer_blocks(g))
    # Under ``comm`` the seconds only break ties: priced without overlap, a replicated weight's
    # gradient all-reduce and a split weight's gather/reduce-scatter stay tied on time as on bytes.
    ov = 0.0 if objective == "comm" else g.profile.grad_overlap if overlap is None else overlap
    for e in g.edges:
        C = e.seconds - ov * e.sync if e.sync is not None and ov else e.seconds
        p.add_edge(e.src, e.dst, C + e.bytes if objective == "comm" else C)
    return p


def layer_blocks(g: PlanGraph) -> tuple[tuple[int, ...], ...]:
    """``g``'s variables by layer (``repeats.find_repeats``' blocks: a module path's first numbered component,
    ``model.layers.7``), each layer's variables in graph order: ``Problem.blocks``, so that a reduction reduces
    each distinct layer once (``search.problem.reduce_blocks``)."""
    members: dict[tuple[str, int], list[int]] = {}
    for i, b in enumerate(block_of(g)):
        if b is not None:
            members.setdefault(b, []).append(i)
    return tuple(tuple(vs) for vs in members.values())


def chain_dual(g: PlanGraph, k: int, runs: Sequence[Run], lams: np.ndarray, budget: float,
               cache: dict | None = None) -> Dual:
    """Choice ``k``'s ``search.chain.Dual`` on its table ``g``, tied by ``runs``, under ``budget`` bytes: ``T``
    member 0 of the capped overlap (``to_problem``'s default), ``M`` the activations phase less the rerun buffers
    (``graph.budget_memory``: never above a plan's modelled peak), as the budget's solves hold it."""
    p = to_problem(g, "time")
    p.memory = [budget_memory(v) for v in g.vars]
    return dual(p, k, runs, lams, budget, [v.rerun_buffer is not None for v in g.vars], cache)


def free_bound(g: PlanGraph, objective: str, runs: Sequence[Run], target: float,
               cache: dict | None = None) -> float:
    """A lower bound of every plan of ``g``'s problem without a memory budget, tied by ``runs`` (``to_problem``'s,
    so member 0 of the capped overlap under ``time``): its reduction's ``lower_bound``, raised by min-sum diffusion
    towards ``target`` when below it.  One reduction, no LP: the cheap bound a solve with a cutoff starts with.
    The reduction is composed from the layers' (``search.problem.reduce_tied``), ``cache`` keeping them for the
    caller's other choices."""
    p = to_problem(g, objective)
    to, n = tied_map(p.n, runs)
    red = reduce_tied(p, to, n, cache)
    bound = lower_bound(red, p)
    return max(bound, diffusion_bound(red, p, target)) if bound < target else bound
