"""Annotate + enumerate: the planning graph of a captured model on one mesh.

Every tensor-producing fx node becomes a *variable* whose domain is its list of
N-D strategies (placeholders: the tilings a parameter, buffer or input may be
stored in; ops: the rule's strategies; the output: all-``R``, the full-output
contract).  Every (producer output -> consumer input) use becomes an *edge*
whose cost matrix ``C[s, t]`` prices resharding producer strategy ``s``'s output
into consumer strategy ``t``'s input, forward and backward.

A value used more than once gets a *reshard point*: a variable between the
producer and its consumers whose domain is (tiling ``T``, axes ``A`` whose
gradient it collects partially).  Consumers that want the same tiling then
share one collective, and partial gradients of replicated uses (Megatron's
``f`` for q, k and v, or the gradient sync of a tied weight) are summed
locally and all-reduced once, as the runtime does.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from . import rules
from .capture import Captured
from .cost.collectives import reshard_cost
from .cost.compute import compute_seconds, flops, fresh_bytes, optimizer_seconds, passes, work_fraction
from .cost.memory import PARAM_COPIES
from .mesh import Mesh
from .cost.profiles import Profile
from .rules.base import OpSpec, Strategy, TensorSpec, expand, make_opspec, strategies_1d
from .tiling import Partial, R, Replicate, Shard, is_valid, max_local_numel

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
    grad_partial: list[tuple[int, ...]] = field(default_factory=list)  # reshard points: per strategy, axes A
    pinned: bool = False          # stored tiling must be used as is (no resharding: model-parallel baseline)


@dataclass
class Edge:
    src: int
    dst: int
    src_out: int
    dst_in: int
    bytes: np.ndarray             # [len(src strategies), len(dst strategies)]
    seconds: np.ndarray
    shape: tuple[int, ...] = ()
    # The part of ``seconds`` the runtime's asynchronous gradient sync takes (the gradient
    # all-reduce of a parameter's own edge, deferred and bucketed by ``GradSync``); else None.
    sync: np.ndarray | None = None


@dataclass
class PlanGraph:
    mesh: Mesh
    profile: Profile
    vars: list[Var] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    shapes: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # placeholder outputs
    dtypes: dict[tuple[int, int], torch.dtype] = field(default_factory=dict)


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


def _needless_partial(g: PlanGraph, s: Strategy, sources: list[tuple[int, int]]) -> bool:
    """A strategy only P/R on some axis, taking a P input there that its producer can never emit.

    Such an input is made partial by zeroing (``to_partial``) and the op then does full-size work
    to produce a pending sum: the all-R choice on that axis does the same work with a replicated
    output, which every consumer converts at no greater cost.  Dropping it keeps the optimum.
    """
    cuts = s.divides_work()
    for a, cut in enumerate(cuts):
        if cut:
            continue
        for t, (u, k) in zip(s.inputs, sources):
            if isinstance(t[a], Partial) and not any(isinstance(st.outputs[k][a], Partial) for st in g.vars[u].strategies):
                return True
    return False


def value_uses(graph: fx.Graph) -> dict[tuple[str, int], int]:
    """How many tensor arguments (ops and graph outputs) read each (producer, output index)."""
    uses: dict[tuple[str, int], int] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "output") or (node.op == "call_function" and node.target is operator.getitem):
            continue
        leaves, _ = tree_flatten((node.args, node.kwargs))
        for a in leaves:
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                src, k = _producer(a)
                uses[(src.name, k)] = uses.get((src.name, k), 0) + 1
    return uses


def reshard_point_name(src: str, k: int) -> str:
    return f"{src}:{k}"


def _add_reshard_points(g: PlanGraph, vi: int, uses: dict[tuple[str, int], int], needs_grad: bool) -> None:
    """After adding producer ``vi``: a reshard point for each of its outputs used more than once."""
    v = g.vars[vi]
    specs = v.op.outputs if v.op is not None else None
    for k in range(len(v.strategies[0].outputs)):
        if uses.get((v.name, k), 0) < 2:
            continue
        tilings = sorted({tuple(s.outputs[k]) for s in v.strategies} | {(R,) * g.mesh.ndim}, key=str)
        strategies, flags = [], []
        for t in tilings:
            r_axes = [a for a in range(g.mesh.ndim) if isinstance(t[a], Replicate)] if needs_grad else []
            for n in range(len(r_axes) + 1):
                for A in itertools.combinations(r_axes, n):
                    strategies.append(Strategy((t,), (t,)))
                    flags.append(tuple(A))
        spec = specs[k] if specs is not None else TensorSpec(g.shapes[(vi, 0)], g.dtypes[(vi, 0)])
        r = _add_var(g, Var(reshard_point_name(v.name, k), "reshard", strategies, np.zeros(len(strategies)), np.zeros(len(strategies)),
                            op=OpSpec("reshard", (), {}, (spec,), (spec,)), module=v.module,
                            needs_grad=needs_grad, grad_partial=flags, fqn=v.fqn, pinned=v.pinned))
        _add_edge(g, vi, r, k, 0, needs_grad)


PINNED = 1e30  # cost of a forbidden resharding


def build(cap: Captured, mesh: Mesh, profile: Profile, *, objective: str = "time", domains: dict[str, list[tuple]] | None = None,
          pin_params: bool = False, local_outputs: bool = False, divide_work: bool | None = None) -> PlanGraph:
    """Variables and edges of ``cap`` on ``mesh``.

    ``domains`` optionally restricts placeholders (by parameter FQN or input name)
    to given tilings: the data- and model-parallel baselines are built this way.
    ``divide_work`` (default: only for the ``comm`` objective) keeps only strategies
    that cut every op's work on every axis wherever the rules allow one.
    """
    g = PlanGraph(mesh, profile)
    domains = domains or {}
    needs_grad: dict[str, bool] = {}
    fallback: set[str] = set()
    uses = value_uses(cap.graph)

    def source(a: fx.Node) -> tuple[int, int]:
        src, k = _producer(a)
        rp = reshard_point_name(src.name, k)
        return (g.index[rp], 0) if rp in g.index else (g.index[src.name], k)

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
            opt_s = np.array([optimizer_seconds(max_local_numel(shape, t, mesh) * val.dtype.itemsize, profile) if needs_grad[node.name] else 0.0
                              for t in tilings])
            vi = _add_var(g, Var(node.name, kind, strategies, opt_s, mem, fqn=fqn, needs_grad=needs_grad[node.name]))
            g.shapes[(vi, 0)], g.dtypes[(vi, 0)] = shape, val.dtype
            g.vars[vi].pinned = pin_params and kind == "param" and fqn in domains
            _add_reshard_points(g, vi, uses, needs_grad[node.name])
        elif node.op == "call_function":
            if node.target is operator.getitem:
                needs_grad[node.name] = needs_grad.get(node.args[0].name, False)
                continue
            op = make_opspec(node.target, node.args, node.kwargs, node.meta.get("val"))
            if rules.lookup(node.target) is None and op.inputs:
                fallback.add(op.name)
            strategies = expand(op, mesh, strategies_1d(op))
            args, _ = tree_flatten((node.args, node.kwargs))
            tensor_args = [a for a in args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            sources = [source(a) for a in tensor_args]
            strategies = [s for s in strategies if not _needless_partial(g, s, sources)] or strategies
            if divide_work if divide_work is not None else objective == "comm":
                # SoyBean: every op's work is divided; redundant compute only where nothing else is legal.
                full = [s for s in strategies if all(s.divides_work())]
                strategies = full or strategies
            n_flops, byts = flops(op)
            rate = profile if not (op.name.startswith("aten.conv") and profile.conv_flops) else replace(profile, flops=profile.conv_flops)
            grads = [needs_grad.get(a.name, False) for a in tensor_args]
            n_pass = passes(op, grads)
            compute = np.array([compute_seconds(n_flops, byts, work_fraction(s.divides_work(), mesh), rate, n_pass, fresh_bytes(op, s, grads, mesh, profile))
                                for s in strategies])
            mem = np.array([sum(max_local_numel(o.shape, t, mesh) * o.dtype.itemsize for o, t in zip(op.outputs, s.outputs)) for s in strategies], dtype=float)
            ng = any(grads) and any(o.dtype.is_floating_point for o in op.outputs)
            needs_grad[node.name] = ng
            v = _add_var(g, Var(node.name, "op", strategies, compute, mem, op=op, module=_module_path(node), needs_grad=ng))
            for i, (a, (u, k)) in enumerate(zip(tensor_args, sources)):
                _add_edge(g, u, v, k, i, needs_grad.get(a.name, False))
            _add_reshard_points(g, v, uses, ng)
        elif node.op == "output":
            outs, _ = tree_flatten(node.args)
            outs = [o for o in outs if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]
            if local_outputs:  # only scalars (losses) must be whole; other outputs stay as tiled
                outs = [o for o in outs if o.meta["val"].dim() == 0]
            st = Strategy(tuple((R,) * mesh.ndim for _ in outs), ())
            v = _add_var(g, Var("output", "output", [st], np.zeros(1), np.zeros(1)))
            for i, a in enumerate(outs):
                u, k = source(a)
                _add_edge(g, u, v, k, i, needs_grad.get(a.name, False))
    g.fallback_ops = sorted(fallback)
    return g


def _add_var(g: PlanGraph, v: Var) -> int:
    g.index[v.name] = len(g.vars)
    g.vars.append(v)
    return len(g.vars) - 1


_EDGE_MEMO: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _unique(keys: list) -> tuple[list, np.ndarray]:
    pos: dict = {}
    idx = np.array([pos.setdefault(k, len(pos)) for k in keys], dtype=np.int64)
    return list(pos), idx


def _add_edge(g: PlanGraph, u: int, v: int, out_idx: int, in_idx: int, needs_grad: bool) -> None:
    su, sv = g.vars[u].strategies, g.vars[v].strategies
    spec = g.vars[v].op.inputs[in_idx] if g.vars[v].op is not None else None
    if spec is None:  # output var: the producer's output spec
        pu = g.vars[u]
        spec = pu.op.outputs[out_idx] if pu.op is not None else None
    shape = spec.shape if spec is not None else g.shapes.get((u, out_idx), ())
    itemsize = spec.dtype.itemsize if spec is not None else g.dtypes[(u, out_idx)].itemsize
    U, V = g.vars[u], g.vars[v]
    src_keys = [(tuple(st.outputs[out_idx]), U.grad_partial[s] if U.kind == "reshard" else ()) for s, st in enumerate(su)]
    dst_keys = []
    for t, s_dst in enumerate(sv):
        dst = tuple(s_dst.inputs[in_idx])
        if V.kind == "reshard":
            pga = V.grad_partial[t]
        else:
            split = s_dst.split_axes() if V.kind == "op" else (False,) * g.mesh.ndim
            pga = tuple(a for a in range(g.mesh.ndim) if split[a] and isinstance(dst[a], Replicate))
        dst_keys.append((dst, pga))
    # Price each distinct (source tiling, target tiling) pair once; repeated layers share the table.
    us, si = _unique(src_keys)
    ud, di = _unique(dst_keys)
    key = (tuple(us), tuple(ud), shape, itemsize, needs_grad, U.pinned, g.mesh, g.profile)
    if key not in _EDGE_MEMO:
        Bu = np.zeros((len(us), len(ud)))
        Tu = np.zeros((len(us), len(ud)))
        Su = np.zeros((len(us), len(ud)))
        for a, (src, spa) in enumerate(us):
            for b, (dst, pga) in enumerate(ud):
                c = reshard_cost(src, dst, shape, itemsize, g.mesh, g.profile, pga, needs_grad, spa)
                Bu[a, b], Tu[a, b], Su[a, b] = c.bytes, c.seconds, c.sync_seconds
                if U.pinned and src != dst:
                    Bu[a, b] = Tu[a, b] = PINNED
                    Su[a, b] = 0.0
        if len(_EDGE_MEMO) > 4096:
            _EDGE_MEMO.clear()
        _EDGE_MEMO[key] = (Bu, Tu, Su)
    Bu, Tu, Su = _EDGE_MEMO[key]
    B, T = Bu[np.ix_(si, di)], Tu[np.ix_(si, di)]
    # Only a parameter's own edge is deferred to the gradient sync (codegen.lower's ``defer``).
    S = Su[np.ix_(si, di)] if U.kind == "param" and Su.any() else None
    g.edges.append(Edge(u, v, out_idx, in_idx, B, T, shape, S))
