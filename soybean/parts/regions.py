"""Regions of a captured graph: its independent branches, found from the graph's fork/join structure.

The graph is read as a directed acyclic graph of *values* (networkx): an edge ``a -> b`` when op ``b`` reads ``a``,
and one source ``SOURCE`` before every value that reads nothing else.  *Free* nodes are left out of it: the
placeholders (parameters, buffers and the model's inputs, which every rank holds under the full-batch contract),
whatever depends on no trained parameter (a constant table, an attention mask or a loss's count of targets made
from the inputs) and whatever depends on no user input (a weight's transpose), since they are computed where they
are read (copied into every region that reads them, as a stage copies a weight; each copy priced in its region).

A node ``c`` that dominates the output (every path from the source to the output passes ``c``: networkx's
``immediate_dominators``) is a *cut*: everything before it is done when it is.  The cuts, in dominance order, cut
the graph into series; the nodes whose nearest dominating cut is ``c`` (``c``'s *interior*) form one or more
weakly connected components.  Two or more components are *branches*: independent computations from one fork to
one join (the towers of a two-tower model, the four of an Inception block), which may run at the same time on
disjoint device groups (DLPlacer).  One component is a serial stretch, read again the same way on its own, from
what it reads to what is read from it (``_series``): so the branches inside a residual block are found too
(attention's q, k and v; an MLP's gate and up).

``segments`` lists the series in graph order, each a ``Segment``: its branches (one for a serial segment), each a
tuple of node names.  ``split`` turns pieces of nodes (a segment, or some of a segment's branches) into
``Region``\\ s: ``part.Part``\\ s (``part.split``, which cuts pipeline stages too, its free nodes copied into their
readers), each taking the whole-graph values it reads from whichever region made them and returning the values
other regions read; running them in order is the captured graph (``part.run_parts``, the serial meaning the tests
check).
"""
from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx

from ..capture.core import Captured
from .part import Part, as_kind, params_read as part_params_read, split as split_parts

SOURCE = "__source__"


@dataclass(frozen=True)
class Segment:
    """One series of the graph: its branches' node names (graph order; a serial segment has one branch)."""

    branches: tuple[tuple[str, ...], ...]

    @property
    def parallel(self) -> bool:
        return len(self.branches) > 1

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for b in self.branches for n in b)


@dataclass
class Region(Part):
    """A piece of the graph run as one program on its group: a ``Part`` (its nodes, its capture, the whole-graph
    values it takes, user inputs or other regions' values, and those it returns, read by a later region; the last
    region returns the model's outputs), and where it sits in the graph's series: its (segment, branch) pieces
    and the placed segment whose other groups run at the same time as it (None: a serial region, alone on every
    device).  Both are a placed plan's (``from_plan``); a region cut from bare node lists has neither."""

    pieces: tuple[tuple[int, int], ...] = ()
    segment: int | None = None


def free_nodes(cap: Captured) -> set[str]:
    """The placeholders, and every node that does not depend on both a user input and a trained parameter
    (module docstring)."""
    trained = {n for n, fqn in cap.params.items() if fqn not in cap.frozen}
    inputs = set(cap.inputs)
    from_input: set[str] = set()
    from_param: set[str] = set()
    free: set[str] = set()
    for n in cap.graph.nodes:
        if n.op == "output":
            continue
        reads = [a.name for a in n.all_input_nodes]
        if n.name in inputs or any(a in from_input for a in reads):
            from_input.add(n.name)
        if n.name in trained or any(a in from_param for a in reads):
            from_param.add(n.name)
        if n.op == "placeholder" or not (n.name in from_input and n.name in from_param):
            free.add(n.name)
    return free


def owners(cap: Captured) -> dict[str, str]:
    """Each node's owner: the op itself, or for an element of a multi-output op (``getitem``) that op, which
    its elements never leave (a region returns whole values)."""
    out: dict[str, str] = {}
    for n in cap.graph.nodes:
        src = n.args[0] if n.target is operator.getitem and n.args and isinstance(n.args[0], fx.Node) else None
        out[n.name] = out[src.name] if src is not None else n.name
    return out


def value_graph(cap: Captured) -> nx.DiGraph:
    """The graph of the values that are not free (``free_nodes``), from ``SOURCE`` to the output node, an element
    of a multi-output op standing for that op (``owners``)."""
    free = free_nodes(cap)
    own = owners(cap)
    g = nx.DiGraph()
    g.add_node(SOURCE)
    for n in cap.graph.nodes:
        if n.name in free or own[n.name] != n.name:
            continue
        g.add_node(n.name)
        reads = {own[a.name] for a in n.all_input_nodes if a.name not in free}
        if not reads:
            g.add_edge(SOURCE, n.name)
        for a in sorted(reads):
            g.add_edge(a, n.name)
    return g


def segments(cap: Captured) -> list[Segment]:
    """The graph's series in graph order (module docstring), found again inside every serial stretch (a residual
    block's branches sit between its input and its sum: ``_series`` on that stretch alone finds them); adjacent
    serial ones merged into one."""
    g = value_graph(cap)
    order = {n.name: i for i, n in enumerate(cap.graph.nodes)}
    output = next(n.name for n in cap.graph.nodes if n.op == "output")
    pieces = _series(g, set(g.nodes) - {SOURCE}, order, output)
    free, own = free_nodes(cap), owners(cap)
    elements: dict[str, list[str]] = {}  # each multi-output op's elements go where it goes
    for n in cap.graph.nodes:
        if n.name not in free and own[n.name] != n.name:
            elements.setdefault(own[n.name], []).append(n.name)
    pieces = [tuple(tuple(x for n in b for x in (n, *elements.get(n, []))) for b in p) for p in pieces]
    out: list[Segment] = []
    for branches in pieces:
        if len(branches) == 1 and out and not out[-1].parallel:  # serial after serial: one segment
            merged = tuple(sorted(out[-1].nodes + branches[0], key=order.__getitem__))
            out[-1] = Segment((merged,))
        else:
            out.append(Segment(branches if len(branches) > 1 else (tuple(sorted(branches[0], key=order.__getitem__)),)))
    return out


SINK = "__sink__"


def _series(g: nx.DiGraph, nodes: set[str], order: dict[str, int], output: str
            ) -> list[tuple[tuple[str, ...], ...]]:
    """The series of the stretch ``nodes`` of the value graph ``g``, in order: each a tuple of branches (one for a
    serial piece).  The stretch is read on its own, from a source before every node that reads from outside it to a
    sink after every node read outside it (and after ``output``, the graph's output node); its cuts are the nodes
    that dominate the sink, and a serial piece of several nodes is read again the same way, so branches nested in a
    serial stretch are found."""
    sub = nx.DiGraph(g.subgraph(nodes))
    sub.add_edge(SOURCE, SINK)  # an empty stretch still has its two ends
    # A value nothing reads that is not the graph's output (an unused pooler, a cache's slices) is no end of the
    # stretch: taken as one, it stood beside the output as a branch of its own (SqueezeBERT's pooler made the head a
    # placed last segment, so one group never ran the output), or kept every later node from dominating the output
    # (Ministral's cache slices hid every branch after them).  A stretch of such values alone ends at them.
    ends = [n for n in nodes if n == output or any(t not in nodes for t in g.successors(n))]
    for n in nodes:
        if g.in_degree(n) == 0 or any(p not in nodes for p in g.predecessors(n)):
            sub.add_edge(SOURCE, n)
    for n in ends or [n for n in nodes if g.out_degree(n) == 0]:
        sub.add_edge(n, SINK)
    sub.remove_edge(SOURCE, SINK)
    idom = nx.immediate_dominators(sub, SOURCE)
    chain = [idom[SINK]]
    while chain[-1] != SOURCE:
        chain.append(idom[chain[-1]])
    cuts = set(chain)
    nearest: dict[str, str] = {}  # each node's nearest dominating cut
    for n in sorted(nodes, key=order.__getitem__):
        if n in cuts:
            continue
        d = idom[n]
        nearest[n] = d if d in cuts else nearest[d]
    pieces: list[tuple[tuple[str, ...], ...]] = []
    for c in reversed(chain):
        if c != SOURCE:
            pieces.append(((c,),))
        interior = [n for n, d in nearest.items() if d == c]
        if not interior:
            continue
        comps = [tuple(sorted(comp, key=order.__getitem__))
                 for comp in nx.weakly_connected_components(g.subgraph(interior))]
        comps.sort(key=lambda b: order[b[0]])
        if len(comps) == 1 and len(comps[0]) > 1 and set(comps[0]) != nodes:
            pieces.extend(_series(g, set(comps[0]), order, output))  # a serial stretch: read again on its own
        else:
            pieces.append(tuple(comps))
    return pieces


def params_read(cap: Captured, nodes: Sequence[str]) -> set[str]:
    """The trained parameters (FQNs) that ``nodes`` read, directly or through the free nodes copied with them."""
    free = free_nodes(cap)
    copied = {n.name for n in cap.graph.nodes if n.name in free and n.op != "placeholder"}
    return set(part_params_read(cap, nodes, copied))


def split(cap: Captured, pieces: Sequence[Sequence[str]]) -> list[Region]:
    """The regions of ``pieces`` (node lists that cover every non-free node once, in an order where a piece reads
    only earlier ones; the last piece holds the output node)."""
    free = free_nodes(cap)
    assigned = {n for piece in pieces for n in piece}
    missing = [n.name for n in cap.graph.nodes if n.name not in free and n.op != "output" and n.name not in assigned]
    if missing:
        raise ValueError(f"the regions do not cover {missing[:5]}")
    return [as_kind(p, Region) for p in split_parts(cap, pieces, "region")]


def shape_key(cap: Captured) -> str:
    """A hash of a capture's computation without its names (ops, constants, shapes and dtypes; values by
    position): two branches or layers that compute alike on alike shapes plan alike."""
    pos: dict[str, int] = {}
    desc: list[Any] = []

    def arg(a: Any) -> Any:
        return ("v", pos[a.name]) if isinstance(a, fx.Node) else repr(a)

    for i, n in enumerate(cap.graph.nodes):
        pos[n.name] = i
        v = n.meta.get("val")
        shape = (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
        trains = n.name in cap.params and cap.params[n.name] not in cap.frozen
        desc.append((n.op, str(n.target), shape, trains, fx.node.map_aggregate((n.args, n.kwargs), arg)))
    return hashlib.sha1(repr(desc).encode()).hexdigest()[:16]
