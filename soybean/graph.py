"""Annotate + enumerate: the planning graph of a captured model on one mesh.

Every tensor-producing fx node becomes a *variable* whose domain is its list of
N-D strategies (placeholders: the tilings a parameter, buffer or input may be
stored in; ops: the rule's strategies; the output: all-``R``, the full-output
contract).  Every (producer output -> consumer input) use becomes an *edge*
whose cost matrix ``C[s, t]`` prices resharding producer strategy ``s``'s output
into consumer strategy ``t``'s input, forward and backward.
"""
from __future__ import annotations

import itertools
import math
import operator
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from . import rules
from .capture import Captured
from .cost import compute_seconds, reshard_cost, work_fraction
from .mesh import Mesh
from .profiles import Profile
from .rules.base import OpSpec, Strategy, TensorSpec, expand, make_opspec, op_name, strategies_1d
from .tiling import R, Replicate, Shard, is_valid, max_local_numel

# Adam/AdamW keep two states per parameter, plus the gradient: 4 copies in all.
PARAM_COPIES = 4


@dataclass
class Var:
    name: str
    kind: str                     # param | buffer | input | op | output
    strategies: list[Strategy]
    compute_s: np.ndarray         # seconds per strategy (training step)
    memory: np.ndarray            # bytes per device per strategy
    fqn: str = ""
    op: OpSpec | None = None
    module: str = ""              # innermost nn.Module path, for reports and tying
    needs_grad: bool = False


@dataclass
class Edge:
    src: int
    dst: int
    src_out: int
    dst_in: int
    bytes: np.ndarray             # [len(src strategies), len(dst strategies)]
    seconds: np.ndarray
    shape: tuple[int, ...] = ()


@dataclass
class PlanGraph:
    mesh: Mesh
    profile: Profile
    vars: list[Var] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)


def _flops(op: OpSpec) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one forward op from its shapes."""
    name = op.name
    out = op.outputs[0] if op.outputs else None
    out_n = math.prod(out.shape) if out else 0
    byts = sum(math.prod(t.shape) * t.dtype.itemsize for t in op.inputs + op.outputs)
    if name in ("aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.matmul.default", "aten.bmm.default", "aten.baddbmm.default"):
        w = op.inputs[1] if name != "aten.addmm.default" and name != "aten.baddbmm.default" else op.inputs[2]
        k = w.shape[-1] if name == "aten.linear.default" else w.shape[-2]
        return 2.0 * out_n * k, byts
    if name.startswith("aten.conv"):
        w = op.inputs[1]
        return 2.0 * out_n * math.prod(w.shape[1:]), byts
    if name == "aten.scaled_dot_product_attention.default":
        q, k = op.inputs[0], op.inputs[1]
        return 4.0 * math.prod(q.shape) * k.shape[-2], byts
    return float(out_n), byts


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _placeholder_tilings(shape: tuple[int, ...], mesh: Mesh) -> list[tuple]:
    options = [R] + [Shard(d) for d in range(len(shape))]
    out = []
    for t in itertools.product(options, repeat=mesh.ndim):
        if is_valid(t, shape, mesh):
            out.append(tuple(t))
    return out


def _producer(arg: fx.Node) -> tuple[fx.Node, int]:
    if arg.op == "call_function" and arg.target is operator.getitem:
        return arg.args[0], int(arg.args[1])
    return arg, 0


def build(cap: Captured, mesh: Mesh, profile: Profile, *, objective: str = "time", domains: dict[str, list[tuple]] | None = None) -> PlanGraph:
    """Variables and edges of ``cap`` on ``mesh``.

    ``domains`` optionally restricts placeholders (by parameter FQN or input name)
    to given tilings: the data- and model-parallel baselines are built this way.
    """
    g = PlanGraph(mesh, profile)
    domains = domains or {}
    needs_grad: dict[str, bool] = {}
    fallback: set[str] = set()
    for node in cap.graph.nodes:
        if node.op == "placeholder":
            if not node.users:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            shape = tuple(int(d) for d in val.shape)
            kind = "param" if node.name in cap.params else "buffer" if node.name in cap.buffers else "input"
            fqn = cap.params.get(node.name) or cap.buffers.get(node.name) or node.name
            tilings = domains.get(fqn) or _placeholder_tilings(shape, mesh)
            tilings = [t for t in tilings if is_valid(t, shape, mesh)] or [(R,) * mesh.ndim]
            strategies = [Strategy((), (t,)) for t in tilings]
            copies = PARAM_COPIES if kind == "param" else 1
            mem = np.array([max_local_numel(shape, t, mesh) * val.dtype.itemsize * copies for t in tilings], dtype=float)
            needs_grad[node.name] = kind == "param" and val.dtype.is_floating_point
            _add_var(g, Var(node.name, kind, strategies, np.zeros(len(strategies)), mem, fqn=fqn, needs_grad=needs_grad[node.name]))
        elif node.op == "call_function":
            if node.target is operator.getitem:
                needs_grad[node.name] = needs_grad.get(node.args[0].name, False)
                continue
            op = make_opspec(node.target, node.args, node.kwargs, node.meta.get("val"))
            if rules.lookup(node.target) is None and op.inputs:
                fallback.add(op.name)
            strategies = expand(op, mesh, strategies_1d(op))
            if objective == "comm":
                # SoyBean: every op's work is divided; redundant compute only where nothing else is legal.
                full = [s for s in strategies if all(s.split_axes())]
                strategies = full or strategies
            flops, byts = _flops(op)
            compute = np.array([compute_seconds(flops, byts, work_fraction(s.split_axes(), mesh), profile) for s in strategies])
            mem = np.array([sum(max_local_numel(o.shape, t, mesh) * o.dtype.itemsize for o, t in zip(op.outputs, s.outputs)) for s in strategies], dtype=float)
            args, _ = tree_flatten((node.args, node.kwargs))
            tensor_args = [a for a in args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            ng = any(needs_grad.get(a.name, False) for a in tensor_args)
            ng = ng and any(o.dtype.is_floating_point for o in op.outputs)
            needs_grad[node.name] = ng
            v = _add_var(g, Var(node.name, "op", strategies, compute, mem, op=op, module=_module_path(node), needs_grad=ng))
            for i, a in enumerate(tensor_args):
                src, k = _producer(a)
                _add_edge(g, g.index[src.name], v, k, i, needs_grad.get(a.name, False))
        elif node.op == "output":
            outs, _ = tree_flatten(node.args)
            outs = [o for o in outs if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]
            st = Strategy(tuple((R,) * mesh.ndim for _ in outs), ())
            v = _add_var(g, Var("output", "output", [st], np.zeros(1), np.zeros(1)))
            for i, a in enumerate(outs):
                src, k = _producer(a)
                _add_edge(g, g.index[src.name], v, k, i, needs_grad.get(a.name, False))
    g.fallback_ops = sorted(fallback)
    return g


def _add_var(g: PlanGraph, v: Var) -> int:
    g.index[v.name] = len(g.vars)
    g.vars.append(v)
    return len(g.vars) - 1


def _add_edge(g: PlanGraph, u: int, v: int, out_idx: int, in_idx: int, needs_grad: bool) -> None:
    su, sv = g.vars[u].strategies, g.vars[v].strategies
    spec = g.vars[v].op.inputs[in_idx] if g.vars[v].op is not None else None
    if spec is None:  # output var: the producer's output spec
        pu = g.vars[u]
        spec = pu.op.outputs[out_idx] if pu.op is not None else None
    shape = spec.shape if spec is not None else ()
    itemsize = spec.dtype.itemsize if spec is not None else 4
    B = np.zeros((len(su), len(sv)))
    T = np.zeros((len(su), len(sv)))
    for t, s_dst in enumerate(sv):
        dst = s_dst.inputs[in_idx]
        split = s_dst.split_axes() if g.vars[v].kind == "op" else (False,) * g.mesh.ndim
        pga = tuple(a for a in range(g.mesh.ndim) if split[a] and isinstance(dst[a], Replicate))
        for s, s_src in enumerate(su):
            src = s_src.outputs[out_idx]
            c = reshard_cost(tuple(src), tuple(dst), shape, itemsize, g.mesh, g.profile, pga, needs_grad)
            B[s, t], T[s, t] = c.bytes, c.seconds
    g.edges.append(Edge(u, v, out_idx, in_idx, B, T, shape))


def warn_fallbacks(g: PlanGraph) -> None:
    if g.fallback_ops:
        warnings.warn(f"soybean: no sharding rule for {', '.join(g.fallback_ops)}; these ops run replicated", stacklevel=3)
