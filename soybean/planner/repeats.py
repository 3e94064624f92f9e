"""Repeated layers of a planning graph, found for tying (``search.tying``).

A transformer's decoder layers are the same subgraph N times.  ``find_repeats`` finds them in a candidate
table: a *block* is every variable whose module path (an op's innermost ``nn.Module``, a parameter's FQN, a
reshard point's source) has the numbered component ``<prefix>.<i>`` (``model.layers.7.mlp.up_proj`` is block 7
of ``model.layers``); two consecutive blocks are *isomorphic* when, variable by variable in graph order, their
kinds, op names, roles, strategy lists, unary costs and memory agree, and so do their edges: each edge into a
block is described by its source (a variable of the same block or of the previous one, by position; any other
variable by identity), its ends and its cost key, and so is each edge out of the block to anything but the next
block.  A maximal run of consecutive isomorphic blocks (at least ``MIN_RUN``) is tied.

Stacks whose layers alternate (EXAONE-4's three sliding-window layers to one of full attention, Gemma 2's and
gpt-oss's two kinds in turn) have few consecutive isomorphic layers, so runs are also sought of *periods*: a block
of ``p`` consecutive layers is tied to the next ``p`` when their layers are isomorphic position by position (each
layer's signature as above: an edge from the layer before names a position in that layer, so also in the block
or the block before).  Per stack, the period (``MAX_PERIOD`` at most) and first layer that tie the most variables
away are kept, the smallest period on a tie, so a stack of equal layers keeps its runs of single layers; only
stacks of whole layers (``MIN_LAYER_VARS``) are tried at periods.  Tying is exact at any period (each tied variable
has its representative's strategies: ``search.tying``); the period decides how much of the stack one tied block
stands for.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from ..graph import PlanGraph
from ..search.tying import Run

# Runs shorter than this are not worth tying.
MIN_RUN = 2
# The longest period of layers tried (``find_repeats``): Gemma 3 repeats five sliding-window layers and one global.
MAX_PERIOD = 8
# Periods are tried only on stacks of whole layers, each at least this many variables (a transformer layer: 78 at
# the least), not on a ``Sequential``'s single ops: VGG's (conv, relu) pairs tied two by two lost to the untied
# optimum (the cheapest layout changes op by op there, before each pooling), where a layer's residual stream keeps
# its tiling from layer to layer.
MIN_LAYER_VARS = 16
_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")



def block_of(g: PlanGraph) -> list[tuple[str, int] | None]:
    """Each variable's block: the stack and layer number of the first numbered component of its module path (an
    op's innermost module, a parameter's or buffer's FQN, a reshard point's source's), None where it has none."""
    out: list[tuple[str, int] | None] = []
    for v in g.vars:
        m = _NUMBERED.match(v.module or v.fqn) if v.kind in ("op", "param", "buffer", "reshard") else None
        out.append((m.group(1), int(m.group(2))) if m else None)
    return out


class _Contents:
    """Small ints naming the contents of the large parts of a signature (a variable's strategy list and cost
    arrays, an edge's key lists): equal contents, equal ints, so the test stays exact; an object that repeated
    layers share (``graph.build`` shares them) is read and hashed once, not once per layer."""

    def __init__(self) -> None:
        self.by_object: dict[int, tuple[int, object]] = {}  # id -> (content number, the object, kept alive)
        self.numbers: dict[Hashable, int] = {}

    def __call__(self, obj: object, content: Callable[[Any], Hashable]) -> int:
        known = self.by_object.get(id(obj))
        if known is None:
            known = self.by_object[id(obj)] = (self.numbers.setdefault(content(obj), len(self.numbers)), obj)
        return known[0]


def _var_key(g: PlanGraph, i: int, prefix: str, c: _Contents, roles: dict[tuple[str, str], str]) -> tuple:
    v = g.vars[i]
    path = v.module or v.fqn
    role = roles.get((prefix, path))
    if role is None:  # its path without the layer number: many variables of a layer share one path
        role = roles[(prefix, path)] = re.sub(r"^" + re.escape(prefix) + r"\.\d+", "", path)
    return (v.kind, v.op.name if v.op is not None else "", role, v.needs_grad, v.pinned, c(v.strategies, tuple),
            c(v.compute_s, _bytes), c(v.memory, _bytes), c(v.grad_partial, tuple))


def _edge_key(g: PlanGraph, k: int, c: _Contents) -> tuple:
    e = g.edges[k]
    return (e.src_out, e.dst_in, e.shape, e.itemsize, e.needs_grad, e.deferred, e.write_back,
            c(e.src_keys, tuple), c(e.src_key_of, _bytes), c(e.dst_keys, tuple), c(e.dst_key_of, _bytes))


def _bytes(a: np.ndarray) -> Hashable:
    return a.dtype.str, a.shape, a.tobytes()


def find_repeats(g: PlanGraph) -> list[Run]:
    """The maximal runs of consecutive isomorphic blocks of ``g`` (module docstring)."""
    block = block_of(g)
    members: dict[tuple[str, int], list[int]] = {}
    for i, b in enumerate(block):
        if b is not None:
            members.setdefault(b, []).append(i)
    pos = {i: k for vs in members.values() for k, i in enumerate(vs)}
    into: dict[int, list[int]] = {}
    out_of: dict[int, list[int]] = {}
    for k, e in enumerate(g.edges):
        into.setdefault(e.dst, []).append(k)
        out_of.setdefault(e.src, []).append(k)

    def ref(i: int, prefix: str, idx: int) -> tuple:
        b = block[i]
        if b == (prefix, idx):
            return ("in", pos[i])
        if b == (prefix, idx - 1):
            return ("prev", pos[i])
        return ("ext", i)

    contents = _Contents()
    roles: dict[tuple[str, str], str] = {}

    def signature(prefix: str, idx: int) -> tuple:
        vs = members[(prefix, idx)]
        sig: list[tuple] = [tuple(_var_key(g, i, prefix, contents, roles) for i in vs)]
        for i in vs:
            for k in into.get(i, []):
                sig.append(("into", pos[i], ref(g.edges[k].src, prefix, idx), _edge_key(g, k, contents)))
            for k in out_of.get(i, []):
                d = g.edges[k].dst
                if block[d] not in ((prefix, idx), (prefix, idx + 1)):
                    sig.append(("out", pos[i], ("ext", d), _edge_key(g, k, contents)))
        return tuple(sig)

    runs: list[Run] = []
    for prefix in sorted({p for p, _ in members}):
        idxs = sorted(i for p, i in members if p == prefix)
        numbers: dict[tuple, int] = {}
        kinds = [numbers.setdefault(signature(prefix, i), len(numbers)) for i in idxs]
        best: list[Run] = []
        whole = min(len(members[(prefix, i)]) for i in idxs) >= MIN_LAYER_VARS
        for period in range(1, min(MAX_PERIOD if whole else 1, len(idxs) // MIN_RUN) + 1):
            for offset in range(period):
                found = _periodic(prefix, idxs, kinds, period, offset, members)
                if _tied_away(found) > _tied_away(best):
                    best = found
        runs.extend(best)
    return runs


def _tied_away(runs: list[Run]) -> int:
    """How many variables tying ``runs`` removes."""
    return sum(len(b) for r in runs for b in r.blocks[1:])


def _periodic(prefix: str, idxs: list[int], kinds: list[int], period: int, offset: int,
              members: dict[tuple[str, int], list[int]]) -> list[Run]:
    """The maximal runs (at least ``MIN_RUN`` blocks) of consecutive equal blocks of ``period`` layers of one stack,
    the first block starting at position ``offset`` of ``idxs`` (the stack's layer numbers; ``kinds``, each layer's
    signature as a small int); each block's variables in layer order."""
    blocks: list[tuple[list[int], tuple[int, ...]] | None] = []
    for s in range(offset, len(idxs) - period + 1, period):
        layers = idxs[s:s + period]
        # a gap in the layers' numbering: no block here
        blocks.append((layers, tuple(kinds[s:s + period])) if layers[-1] - layers[0] == period - 1 else None)
    runs: list[Run] = []
    start = 0
    for j in range(1, len(blocks) + 1):
        a, b = blocks[start], blocks[j] if j < len(blocks) else None
        prev = blocks[j - 1]
        if a is not None and b is not None and prev is not None and b[0][0] == prev[0][-1] + 1 and b[1] == a[1]:
            continue
        if a is not None and j - start >= MIN_RUN:
            chosen = [c[0] for c in blocks[start:j] if c is not None]
            runs.append(Run(prefix, chosen[0][0], chosen[-1][-1],
                            tuple(tuple(v for i in layers for v in members[(prefix, i)]) for layers in chosen),
                            period))
        start = j
    return runs
