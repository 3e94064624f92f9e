"""Layers and recomputation units of a captured graph: which module path an op lies in, which layers may run
twice, selective recomputation's attention units, and what recomputing them changes (``_Rerun``).  Pipeline
stages will be cut along the same units."""
from __future__ import annotations

import math
import operator
from collections.abc import Collection, Hashable

import numpy as np
from torch import fx

from .. import rules
from ..capture.core import Captured
from ..cost.memory import (
    activation_bytes,
    activation_key,
    liveness,
    output_bytes,
)
from ..mesh import Mesh
from ..rules.base import OpSpec, Strategy, make_opspec, tensor_args
from .types import PlanGraph
from .writes import may_write, written_inputs


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def layer_of(module_path: str) -> str:
    """The layer a module path lies in: a block of a repeated stack, the path up to its first numeric part
    (``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``); ``""`` for none.  Recomputation's unit."""
    parts = module_path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ""


def node_layer(node: fx.Node) -> str:
    """The layer of a captured op (``layer_of`` its module path)."""
    return layer_of(_module_path(node))


def unit_of(module_path: str, units: Collection[str]) -> str:
    """The recomputation unit of ``units`` (module paths: a layer, or a module inside one) that contains
    ``module_path``, the innermost when they nest; ``""`` for none."""
    parts = module_path.split(".")
    for i in range(len(parts), 0, -1):
        if (u := ".".join(parts[:i])) in units:
            return u
    return ""


def node_module(node: fx.Node) -> str:
    """The innermost ``nn.Module`` path of a captured op (``""`` for none)."""
    return _module_path(node)


# Ops whose module is a layer's attention (selective recomputation's unit, Korthikanti et al. 2022).
ATTENTION_OPS = ("aten.scaled_dot_product_attention.default", "aten._softmax.default", "aten.softmax.int")


def recomputable_layers(cap: Captured) -> list[str]:
    """The layers whose forward may run twice, in graph order: none of their ops updates a tensor in place
    (batch norm's running statistics would move twice) or is windowed (``rules.window``: halo windows pack
    their own saved tensors)."""
    layers: dict[str, bool] = {}
    for n in cap.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem or not node_layer(n):
            continue  # not an op, or in no layer
        layer = node_layer(n)
        entry = rules.lookup(n.target)
        windows = entry is not None and entry.windows is not None
        if not layers.get(layer, True) or not (windows or may_write(n.target)):
            layers.setdefault(layer, True)  # already out, or an op that can neither write nor window: no spec built
            continue
        op = make_opspec(n.target, n.args, n.kwargs, n.meta.get("val"))
        windowed = entry is not None and entry.windows is not None and bool(entry.windows(op))
        layers[layer] = not windowed and not written_inputs(op)
    return [k for k, ok in layers.items() if ok]


def attention_units(cap: Captured) -> list[str]:
    """Selective recomputation's units, in graph order: in each recomputable layer, the module directly
    below the layer that holds its attention (``transformer.h.3.attn``, ``model.layers.3.self_attn``),
    found by its op (``ATTENTION_OPS``); a layer whose attention is not in a submodule of its own has none."""
    ok = set(recomputable_layers(cap))
    out: dict[str, None] = {}
    for n in cap.graph.nodes:
        if n.op != "call_function" or str(n.target) not in ATTENTION_OPS:
            continue
        path, layer = _module_path(n), node_layer(n)
        if layer in ok and path.startswith(layer + "."):
            out[".".join(path.split(".")[:len(layer.split(".")) + 1])] = None
    return list(out)


class _Rerun:
    """What recomputing the units ``layers`` changes (``codegen.recompute``; a unit is a layer or a module
    inside one, ``unit_of``): which ops rerun, what stays live at the end of forward (``cost.memory.liveness``
    with the units: a unit's checkpoint keeps what it reads from outside), and, per value used more than
    once, the unit of its first reader (where lowering emits its shared reshard, so whether that reshard
    reruns)."""

    def __init__(self, graph: fx.Graph, layers: frozenset[str]) -> None:
        self.layers = layers
        self.layer: dict[str, str] = {}
        self.units: dict[str, str] = {}             # a recomputed op -> its unit
        self.first: dict[tuple[str, int], str] = {}
        self.count: dict[str, int] = {}            # a recomputed unit -> the units of its role
        self.plain = liveness(graph)                # what forward keeps with nothing recomputed
        self.kept = self.plain                      # ... and with these units recomputed
        if not layers:
            return
        for n in graph.nodes:
            if n.op == "call_function" and n.target is not operator.getitem:
                self.layer[n.name] = unit_of(_module_path(n), layers)
            if n.op not in ("call_function", "output") or n.target is operator.getitem:
                continue
            reader = self.layer.get(n.name, "")
            for a in tensor_args(n):
                src: tuple[str, int] = ((str(a.args[0].name), int(a.args[1]))  # type: ignore[union-attr, arg-type]
                                        if a.target is operator.getitem else (a.name, 0))
                self.first.setdefault(src, reader)
        self.units = {k: u for k, u in self.layer.items() if u}
        # Units rerun one at a time: the buffer is the largest unit's activations, charged to each unit of a
        # role (its path without the layer number: ``h.*`` or ``h.*.attn``) as 1 / (units of that role),
        # exact for a stack of equal layers; roles add (an upper bound: one unit reruns at a time).
        roles: dict[str, set[str]] = {}
        for u in set(self.units.values()):
            roles.setdefault(_role(u), set()).add(u)
        self.count = {u: len(us) for us in roles.values() for u in us}
        self.kept = liveness(graph, self.units)

    def op(self, name: str) -> bool:
        return name in self.units

    def key(self, node: fx.Node) -> Hashable:
        """What an op's priced tables depend on here: what it keeps (``activation_key``), and when it reruns,
        what it would keep otherwise and its role's unit count."""
        if not self.layers:
            return activation_key(node, info=self.plain)
        rerun = (activation_key(node, info=self.plain), self.count[self.units[node.name]]) if self.op(node.name) \
            else None
        return activation_key(node, self.units, self.kept), rerun

    def memory(self, node: fx.Node, op: OpSpec, strategies: list[Strategy],
               mesh: Mesh) -> tuple[np.ndarray, np.ndarray | None]:
        """An op's bytes at the end of forward, and the share of them that is a rerun buffer.  What it keeps
        is ``liveness`` with the units (a recomputed op: only what a checkpoint or an op outside its unit
        keeps of its outputs); a recomputed op adds, for while its unit reruns in backward, its usual bytes:
        one unit at a time, charged as ``1 / count`` of each recomputed op (exact for a stack of equal
        layers; ``rerun_credit`` takes back what surely is freed by then)."""
        if not self.layers:
            return activation_bytes(node, op, strategies, mesh, info=self.plain), None
        kept = activation_bytes(node, op, strategies, mesh, self.units, self.kept)
        if not self.op(node.name):
            return kept, None
        buffer = activation_bytes(node, op, strategies, mesh, info=self.plain) / self.count[self.units[node.name]]
        return kept + buffer, buffer


    def working_set(self, g: PlanGraph) -> None:
        """Add to each recomputed unit's rerun buffer its backward's working set: the gradient of its largest
        output (``Var.transient``'s argument, inside the unit: while the unit's backward runs, its activations are
        all back and the gradient of its widest op is held), charged as the buffers are, ``1 / count``."""
        largest: dict[str, tuple[int, int]] = {}  # unit -> (output size, var index)
        for i, v in enumerate(g.vars):
            if v.rerun_buffer is None or v.op is None or not v.needs_grad:
                continue
            size = sum(math.prod(o.shape) * o.dtype.itemsize for o in v.op.outputs)
            unit = self.units[v.name]
            if size > largest.get(unit, (-1, -1))[0]:
                largest[unit] = (size, i)
        for unit, (_, i) in largest.items():
            v = g.vars[i]
            assert v.op is not None and v.rerun_buffer is not None
            extra = output_bytes(v.op, v.strategies, g.mesh) / self.count[unit]
            v.memory, v.rerun_buffer = v.memory + extra, v.rerun_buffer + extra


def _role(unit: str) -> str:
    """A unit's role: its path with the layer number starred (``transformer.h.3.attn`` -> ``transformer.h.*.attn``)."""
    return ".".join("*" if p.isdigit() else p for p in unit.split("."))
