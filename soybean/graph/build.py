"""Building the planning graph: ``build`` (the package docstring says what it decides)."""
from __future__ import annotations

import gc
import itertools
import math
import operator
from collections.abc import Collection, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from .. import rules
from ..capture.core import Captured
from ..capture.passes.mark_returned_sums import RETURNED_SUM
from ..cost.collectives import has_comm, op_comm_costs, price_route_ids
from ..cost.compute import op_seconds, optimizer_step_seconds
from ..cost.memory import (
    grad_phase_bytes,
    param_bytes,
    sync_bucket_bytes,
)
from ..cost.pricing import EdgeTables, PricingCache
from ..cost.profiles import Profile
from ..ir.attention import SDPA
from ..mesh import Mesh
from ..plan import Plan, Program
from ..precision import policy
from ..rules.attention import cp_method, row_axes
from ..rules.base import OpSpec, Strategy, TensorSpec, expand, make_opspec, node_spec, strategies_1d, tensor_args
from ..rules.datadep import data_dependent
from ..rules.views import RESHAPES, may_copy
from ..tiling import Partial, R, Replicate, Shard, is_valid
from .phases import backward_transient, hold_inflight, rerun_credit
from .pinning import PINNED, pinned_use, use_tiling
from .types import Edge, PlanGraph, Var
from .units import _module_path, _Rerun
from .writes import written_inputs


class SharedWork:
    """The part of ``_Memo`` that outlives one build: classes and keys by content, and the work found under them.
    Builds of one capture on one mesh with one set of settings (objective, domains, pinning) that differ only in
    what they recompute share it (``planner.solve_recompute``): an op's key says what it keeps and whether it
    reruns, so the layers two recomputation choices treat alike are built once for both, and what recomputation
    never changes (a node's spec, a placeholder's tilings and costs, an op's domain and own compute) is kept by
    node name or by the key without what the op keeps, and read by every build."""

    def __init__(self) -> None:
        self.classes: dict[Hashable, int] = {}
        self.keys: dict[Hashable, int] = {}
        self.vars: dict[int, tuple[list[Strategy], np.ndarray, np.ndarray, int, np.ndarray | None,
                                   np.ndarray | None]] = {}
        self.edges: dict[tuple, Edge] = {}
        # an op node's spec, rule-less flag, op key id, may-copy flag and written inputs by name (``_Builder._node``)
        self.nodes: dict[str, tuple[OpSpec, bool, int | None, bool, list[int]]] = {}
        # a placeholder's strategies, gradient flag, bytes, gradients-phase bytes and optimizer seconds by name
        self.placeholders: dict[str, tuple[list[Strategy], bool, np.ndarray, np.ndarray | None, np.ndarray]] = {}
        # an op's strategies and compute seconds by its key without what it keeps (``_Rerun.key``), and its
        # forward-only seconds once a rerun or its own collectives ask: recomputation changes an op's memory and
        # adds its forward again, never its domain or its own compute, so every recomputation choice finds them here
        self.domains: dict[int, tuple[list[Strategy], np.ndarray]] = {}
        self.forwards: dict[int, np.ndarray] = {}
        # a reshard point's domain by (its producer's class, output, gradient flag), and its class by key id
        self.points: dict[tuple[int, int, bool], tuple[list[Strategy], list[tuple[int, ...]]]] = {}
        self.point_classes: dict[int, int] = {}


class _Memo:
    """Work a build shares between repeated layers.

    A variable's *content class* names everything a consumer or an edge reads of it as a source: its
    kind, output specs, each strategy's output tilings, partial-gradient axes, pinning and gradient
    flag.  A variable's *key* names everything its own domain and costs depend on: for an op, the op
    (target, argument specs, constants), its sources' content classes, which inputs need a gradient,
    and what it keeps for backward.  Two ops with one key get the same strategies, compute and memory
    arrays.  Its *domain key* leaves out what it keeps (``SharedWork.domains``): two ops with one domain key get
    the same strategies and own compute, and two uses with the same source class, consumer domain key (a reshard
    point's key) and slots get the same edge tables, whatever either layer recomputes.
    The classes are by content, not by identity, so layer ``i + 1`` of a stack, whose input is layer
    ``i``'s output, finds layer ``i``'s work once the two layers' outputs agree: a 32-layer Llama's
    table costs about three layers.  Shared arrays are made read-only, so a caller that writes into
    one fails loudly instead of changing another variable's costs.
    """

    def __init__(self, work: SharedWork | None = None) -> None:
        work = work or SharedWork()
        self.classes, self.keys, self.vars, self.edges = work.classes, work.keys, work.vars, work.edges
        self.domains, self.forwards = work.domains, work.forwards
        self.placeholders, self.nodes = work.placeholders, work.nodes
        self.points, self.point_classes = work.points, work.point_classes
        self.cls: dict[int, int] = {}     # var index -> content class
        self.key: dict[int, int] = {}     # var index -> the key id its edges read (an op's domain key; a point's key)

    def classify(self, g: PlanGraph, vi: int) -> int:
        v = g.vars[vi]
        specs = v.op.outputs if v.op is not None else ((g.shapes.get((vi, 0)), g.dtypes.get((vi, 0))),)
        content = (v.kind, specs, tuple(tuple(st.outputs) for st in v.strategies), tuple(v.grad_partial),
                   v.pinned, v.gathered, v.needs_grad)
        self.cls[vi] = c = self.classes.setdefault(content, len(self.classes))
        return c

    def key_id(self, key: Hashable) -> int:
        return self.keys.setdefault(key, len(self.keys))


class _Unhashable(Exception):
    pass


def _frozen(x: Any) -> Hashable:
    """``x`` as a hashable value that tells apart what ``==`` does not (``1``, ``1.0``, ``True``)."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_frozen(y) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted(((str(k), _frozen(v)) for k, v in x.items()), key=lambda kv: kv[0])))
    if isinstance(x, slice):
        return ("slice", _frozen(x.start), _frozen(x.stop), _frozen(x.step))
    try:
        hash(x)
    except TypeError as e:
        raise _Unhashable from e
    return (type(x).__name__, x)


def op_key(op: OpSpec) -> Hashable | None:
    """What an op's strategies and costs depend on besides its sources; None when an argument cannot be hashed."""
    try:
        return (op.target, _frozen(op.args), _frozen(op.kwargs), op.inputs, op.outputs)
    except _Unhashable:
        return None



def _placeholder_tilings(shape: tuple[int, ...], mesh: Mesh) -> list[tuple]:
    options = [R] + [Shard(d) for d in range(len(shape))]
    out = []
    for t in itertools.product(options, repeat=mesh.ndim):
        if is_valid(t, shape, mesh):
            out.append(tuple(t))
    return out


def _producer(arg: fx.Node) -> tuple[fx.Node, int]:
    if arg.op == "call_function" and arg.target is operator.getitem:
        src, idx = arg.args[0], arg.args[1]
        assert isinstance(src, fx.Node) and isinstance(idx, int)
        return src, int(idx)
    return arg, 0


def _needless_partial(s: Strategy, emits: list[tuple[bool, ...]]) -> bool:
    """A strategy only P/R on some axis, taking a P input there that its producer can never emit (``emits``: per
    input, per mesh axis, whether some strategy of its producer outputs ``P`` there: ``partial_axes``).

    Such an input is made partial by zeroing (``to_partial``) and the op then does full-size work
    to produce a pending sum: the all-R choice on that axis does the same work with a replicated
    output, which every consumer converts at no greater cost.  Dropping it keeps the optimum.
    """
    cuts = s.divides_work()
    for a, cut in enumerate(cuts):
        if cut:
            continue
        for t, can in zip(s.inputs, emits):
            if isinstance(t[a], Partial) and not can[a]:
                return True
    return False


def partial_axes(v: Var, k: int, axes: int) -> tuple[bool, ...]:
    """Per mesh axis: whether some strategy of ``v`` outputs ``P`` there on its output ``k``."""
    return tuple(any(isinstance(st.outputs[k][a], Partial) for st in v.strategies) for a in range(axes))


def value_uses(graph: fx.Graph) -> dict[tuple[str, int], int]:
    """How many tensor arguments (ops and graph outputs) read each (producer, output index)."""
    uses: dict[tuple[str, int], int] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        for a in tensor_args(node):
            src, k = _producer(a)
            uses[(src.name, k)] = uses.get((src.name, k), 0) + 1
    return uses


def reshard_point_name(src: str, k: int) -> str:
    return f"{src}:{k}"


def value_source(g: PlanGraph, a: fx.Node) -> tuple[int, int]:
    """(var, output index) a use of fx value ``a`` reads: its producer's output, or the shared
    reshard point of that output when it has one."""
    src, k = _producer(a)
    rp = reshard_point_name(src.name, k)
    return (g.index[rp], 0) if rp in g.index else (g.index[src.name], k)


def _add_reshard_points(g: PlanGraph, vi: int, uses: dict[tuple[str, int], int], needs_grad: bool,
                        fixed: Program | None = None, memo: _Memo | None = None, rerun: _Rerun | None = None) -> None:
    """After adding producer ``vi``: a reshard point for each of its outputs used more than once
    (with ``fixed``, the tiling and partial-gradient axes that plan chose for it)."""
    v = g.vars[vi]
    specs = v.op.outputs if v.op is not None else None
    for k in range(len(v.strategies[0].outputs)):
        if uses.get((v.name, k), 0) < 2:
            continue
        name = reshard_point_name(v.name, k)
        domain = (memo.cls[vi], k, needs_grad) if memo is not None and fixed is None else None
        known = memo.points.get(domain) if memo is not None and domain is not None else None
        if known is not None:  # the domain follows from the producer's class: a repeated layer's is shared
            strategies, flags = known
        else:
            strategies, flags = _point_domain(g, v, k, needs_grad, name, fixed)
            if memo is not None and domain is not None:
                memo.points[domain] = (strategies, flags)
        spec = specs[k] if specs is not None else TensorSpec(g.shapes[(vi, 0)], g.dtypes[(vi, 0)])
        r = _add_var(g, Var(name, "reshard", strategies, np.zeros(len(strategies)), np.zeros(len(strategies)),
                            op=OpSpec("reshard", (), {}, (spec,), (spec,)), module=v.module,
                            needs_grad=needs_grad, grad_partial=flags, fqn=v.fqn, pinned=v.pinned,
                            gathered=v.gathered))
        again = rerun is not None and rerun.first.get((v.name, k), "") in rerun.layers  # emitted in a rerun layer
        if memo is not None:  # its domain, and so its class, follows from its producer's class and the output read
            kid = memo.key[r] = memo.key_id(("reshard", memo.cls[vi], k, needs_grad, again))
            if kid in memo.point_classes:
                memo.cls[r] = memo.point_classes[kid]
            else:
                memo.point_classes[kid] = memo.classify(g, r)
        _add_edge(g, vi, r, k, 0, needs_grad, memo=memo, rerun=again)


def _point_domain(g: PlanGraph, v: Var, k: int, needs_grad: bool, name: str,
                  fixed: Program | None) -> tuple[list[Strategy], list[tuple[int, ...]]]:
    """The strategies of the reshard point of ``v``'s output ``k`` and the axes each collects partial gradients
    on: every tiling the producer emits (and all-R, and a pinned one's use tiling) with each subset of its
    replicated axes; with ``fixed``, the plan's own."""
    strategies: list[Strategy] = []
    flags: list[tuple[int, ...]] = []
    if fixed is not None and name in fixed.nodes:
        ins, outs = fixed.node_tilings(name)
        strategies.append(Strategy(tuple(ins), tuple(outs)))
        flags.append(fixed.grad_partial_axes(name) if needs_grad else ())
    tilings = [] if strategies else sorted(
        {tuple(s.outputs[k]) for s in v.strategies} | {(R,) * g.mesh.ndim}
        | {use_tiling(tuple(s.outputs[k]), v.gathered) for s in v.strategies if v.pinned}, key=str
    )
    for t in tilings:
        r_axes = [a for a in range(g.mesh.ndim) if isinstance(t[a], Replicate)] if needs_grad else []
        for n in range(len(r_axes) + 1):
            for A in itertools.combinations(r_axes, n):
                strategies.append(Strategy((t,), (t,)))
                flags.append(tuple(A))
    return strategies, flags


def fallback_ops(cap: Captured) -> list[str]:
    """The ops of ``cap`` that have no rule (and read a tensor): they run replicated (``PlanGraph.fallback_ops``)."""
    out = set()
    for n in cap.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem and rules.lookup(n.target) is None:
            op = make_opspec(n.target, n.args, n.kwargs, n.meta.get("val"))
            if op.inputs:
                out.add(op.name)
    return sorted(out)



def build(
    cap: Captured,
    mesh: Mesh,
    profile: Profile,
    *,
    objective: str = "time",
    domains: dict[str, list[tuple]] | None = None,
    pin_params: bool = False,
    local_outputs: bool = False,
    lazy_outputs: bool = False,
    divide_work: bool | None = None,
    fixed: Plan | Program | None = None,
    gather_axes: tuple[int, ...] = (),
    gather_of: dict[str, tuple[int, ...]] | None = None,
    context_parallel: str | int | tuple[int, ...] = "auto",
    context_parallel_method: str = "auto",
    share: bool = True,
    recompute: Collection[str] = (),
    pricing: PricingCache | None = None,
    work: SharedWork | None = None,
    priced: bool = True,
    inflight: int = 1,
) -> PlanGraph:
    """Variables and edges of ``cap`` on ``mesh``.

    ``domains`` optionally restricts placeholders (by parameter FQN or input name)
    to given tilings: the baselines (``soybean.planner.baselines``) are built this way.
    ``pin_params``: a parameter in ``domains`` is used in the tiling it is stored in (any other use
    costs ``PINNED``), except on the ``gather_axes``, where it is used whole: gathered for use and its
    gradient reduce-scattered back, as FSDP (ZeRO-3) does; ``gather_of`` gives some parameters (by FQN) their own
    gather axes (an expert weight split by expert parallelism on one axis, FSDP on the others).
    ``context_parallel``: ``auto`` lets every attention op split its query rows or not; ``none`` forbids it; ``N``
    keeps only the strategies that split them exactly ``N`` ways (``records.context_parallel_records``), and a mesh
    with none raises ``NoStrategyLeft`` (the planner's ``SearchError`` for that mesh); a tuple of mesh axes (a
    baseline's, ``baselines.cp_tp_fsdp``) keeps only those splitting them on exactly those axes.
    ``context_parallel_method`` (``all_gather_kv`` or ``ring``; ``auto``: either) keeps, of the strategies
    splitting the query rows, those of that method (``rules.attention.cp_method``).
    ``lazy_outputs`` (the full-batch contract with ``PlanOptions.outputs`` ``lazy``): a non-scalar output may leave
    split along dim 0 (``lazy_output_tilings``), as ``run.outputs.LazyFull`` hands it to the loop, instead of whole.
    ``divide_work`` (default: only for the ``comm`` objective) keeps only strategies
    that cut every op's work on every axis wherever the rules allow one.
    ``fixed``: every variable takes the one strategy ``fixed`` chose (and its output contract);
    the graph codegen lowers.
    ``share``: repeated layers reuse the first one's strategies and priced tables (``_Memo``; False
    prices every variable afresh, as the tests do to check the sharing).
    ``recompute``: the layers (``layer_of``) whose forward reruns in backward (with
    ``fixed``, the plan's): their ops keep only what leaves the layer, pay one more forward pass, and the
    forward collectives of the reads inside the layer run again (``_Rerun``).
    ``pricing``: the planner run's ``cost.pricing.PricingCache``, shared by every table it builds (a fresh one
    when none is given).  ``work``: ``SharedWork`` of earlier builds with the same mesh, profile and settings
    (only ``recompute`` may differ).  ``priced=False``: the edges' byte and second tables are left zero
    (``PlanGraph.priced``; for a lowering, which reads routes only).  ``inflight``: the microbatches whose
    activations are held at once (a pipeline stage's): each op's kept bytes priced that many times
    (``phases.hold_inflight``).
    """
    if fixed is not None:  # what runs (a plan's record is not read), named as this capture names its nodes
        fixed = (fixed.program if isinstance(fixed, Plan) else fixed).aligned(cap.keys)
    with gc_paused():
        g = PlanGraph(mesh, profile, pricing=pricing or PricingCache(), priced=priced)
        return _Builder(g, cap, objective, domains or {},
                        pin_params, local_outputs, lazy_outputs, divide_work, fixed, tuple(gather_axes),
                        dict(gather_of or {}),
                        context_parallel, context_parallel_method, share,
                        frozenset(fixed.recompute if fixed is not None else recompute), work).run(inflight)


class NoStrategyLeft(ValueError):
    """An option left some op no strategy on this mesh (``--context-parallel N`` on a mesh without such axes)."""


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building a table allocates millions of small objects and
    frees few, and the collector's passes over them took ~40% of building GPT-2's table on a 2x2x2
    mesh (reference counting still frees everything that is not a cycle)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Builder:
    """One ``build``: the planning graph of ``cap``, one method per captured node kind (as ``codegen.Lowering``)."""

    def __init__(self, g: PlanGraph, cap: Captured, objective: str, domains: dict[str, list[tuple]],
                 pin_params: bool, local_outputs: bool, lazy_outputs: bool, divide_work: bool | None,
                 fixed: Program | None,
                 gather_axes: tuple[int, ...], gather_of: dict[str, tuple[int, ...]],
                 context_parallel: str | int | tuple[int, ...], cp_method: str,
                 share: bool,
                 recompute: frozenset[str],
                 work: SharedWork | None = None) -> None:
        self.g, self.cap, self.objective, self.domains = g, cap, objective, domains
        self.pin_params, self.divide_work, self.fixed, self.gather_axes = pin_params, divide_work, fixed, gather_axes
        self.gather_of, self.context_parallel, self.cp_method = gather_of, context_parallel, cp_method
        self.mesh, self.profile = g.mesh, g.profile
        self.local_outputs = fixed.local_batch if fixed is not None else local_outputs
        self.lazy_outputs = lazy_outputs and not self.local_outputs
        self.rerun = _Rerun(cap.graph, recompute)
        master_dtype = policy(cap.precision).master
        g.master_itemsize = master_dtype.itemsize if master_dtype is not None else 0
        self.needs_grad: dict[str, bool] = {}
        # Values computed from parameters and buffers alone (a norm's weight cast to float32): no batch in them, so
        # ``divide_work`` never asks their ops to divide work a batch split cannot divide.
        self.weights_only: set[str] = set()
        self.fallback: set[str] = set()
        self.uses = value_uses(cap.graph)
        self.full = (R,) * g.mesh.ndim
        # A fixed graph has one strategy per variable: nothing to share.
        self.memo = _Memo(work) if fixed is None and share else None

    def run(self, inflight: int = 1) -> PlanGraph:
        for node in self.cap.graph.nodes:
            if node.op in ("placeholder", "call_function", "output"):
                getattr(self, node.op)(node)
        g = self.g
        g.fallback_ops = sorted(self.fallback)
        g.data_dependent = data_dependent(self.cap.graph)
        hold_inflight(g, inflight)  # before the transient and the reruns' buffers, which are one microbatch's
        backward_transient(g)
        self.rerun.working_set(g)
        g.rerun_credit = rerun_credit(g)
        return g

    def placeholder(self, node: fx.Node) -> None:
        """A parameter, buffer or input: its stored tilings, optimizer time, memory and its reshard points."""
        if not node.users:
            return
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return
        g, cap = self.g, self.cap
        shape = tuple(int(d) for d in val.shape)
        kind = "param" if node.name in cap.params else "buffer" if node.name in cap.buffers else "input"
        fqn = cap.params.get(node.name) or cap.buffers.get(node.name) or node.name
        if kind != "input":
            self.weights_only.add(node.name)
        known = self.memo.placeholders.get(node.name) if self.memo is not None else None
        strategies, ng, mem, gp, opt_s = known or self._stored(node, val, kind, fqn, shape)
        if self.memo is not None and known is None:  # the same in every build sharing the work: recomputation
            for arr in (mem, gp, opt_s):                  # never changes it (read-only: shared, as an op's are)
                if arr is not None:
                    arr.flags.writeable = False
            self.memo.placeholders[node.name] = (strategies, ng, mem, gp, opt_s)
        self.needs_grad[node.name] = ng
        vi = _add_var(g, Var(node.name, kind, strategies, opt_s, mem, fqn=fqn, needs_grad=ng, grad_phase=gp))
        g.shapes[(vi, 0)], g.dtypes[(vi, 0)] = shape, val.dtype
        g.vars[vi].pinned = self.pin_params and kind == "param" and fqn in self.domains
        g.vars[vi].gathered = self.gather_of.get(fqn, self.gather_axes) if g.vars[vi].pinned else ()
        if self.memo is not None:
            self.memo.classify(g, vi)
        _add_reshard_points(g, vi, self.uses, ng, self.fixed, self.memo, self.rerun)

    def _stored(self, node: fx.Node, val: torch.Tensor, kind: str, fqn: str,
                shape: tuple[int, ...]) -> tuple[list[Strategy], bool, np.ndarray, np.ndarray | None, np.ndarray]:
        """A placeholder's stored tilings (as strategies), whether it gets a gradient, its bytes, its bytes in the
        gradients phase and its optimizer seconds, per tiling."""
        g, cap, mesh = self.g, self.cap, self.mesh
        if self.fixed is not None:
            tilings = [self.fixed.param_tiling(fqn) if kind != "input" else self.fixed.input_tiling(fqn)]
        else:
            tilings = self.domains.get(fqn) or _placeholder_tilings(shape, mesh)
            tilings = [t for t in tilings if is_valid(t, shape, mesh)] or [self.full]
        strategies = [Strategy((), (t,)) for t in tilings]
        # A frozen parameter (``requires_grad=False``) gets no gradient, no sync and no optimizer state.
        # An input needs one when its example tensor requires it (``Captured.grad_inputs``: an activation entering a
        # piece of a model), so that a split use's partial gradients are summed before they leave.
        ng = val.dtype.is_floating_point and (
            (kind == "param" and fqn not in cap.frozen) or (kind == "input" and node.name in cap.grad_inputs))
        # Under a mixed policy a parameter is stored as its master (``g.master_itemsize``), frozen or not.
        master_b = g.master_itemsize if kind == "param" and val.dtype.is_floating_point and g.master_itemsize else 0
        foreach = self.profile.optimizer_foreach
        mem = param_bytes(node, shape, val.dtype.itemsize, tilings, mesh, kind if ng or kind != "param" else "frozen",
                          master_b, foreach)
        gp = None
        trained = ng and kind == "param"  # an input's gradient has no sync bucket, master or optimizer state
        if trained:
            # Its gradient and its share of the gradient-sync buckets (reduced in the compute dtype) exist
            # only once backward has made them: the gradients phase (``phase_memory``).
            sync = sync_bucket_bytes(shape, val.dtype.itemsize, tilings, mesh)
            mem = mem + sync
            gp = grad_phase_bytes(node, shape, val.dtype.itemsize, tilings, mesh, master_b, foreach) + sync
        opt_s = optimizer_step_seconds(shape, master_b or val.dtype.itemsize, tilings, mesh, self.profile, trained)
        return strategies, ng, mem, gp, opt_s

    def call_function(self, node: fx.Node) -> None:
        """An op: its strategies (shared with an equal op of a repeated layer), compute, memory and the edges it
        reads, writes back and is read through."""
        if node.target is operator.getitem:
            src = node.args[0]
            assert isinstance(src, fx.Node)  # a getitem of a multi-output op
            self.needs_grad[node.name] = self.needs_grad.get(src.name, False)
            if src.name in self.weights_only:
                self.weights_only.add(node.name)
            return
        g, mesh, profile, memo, rerun, fixed = self.g, self.mesh, self.profile, self.memo, self.rerun, self.fixed
        op, fallback, okid, copies, written = self._node(node)
        if fallback:
            self.fallback.add(op.name)
        targs = tensor_args(node)
        sources = [value_source(g, a) for a in targs]
        grads = [self.needs_grad.get(a.name, False) for a in targs]
        weights = bool(targs) and all(a.name in self.weights_only for a in targs)
        if weights:
            self.weights_only.add(node.name)
        kid = did = None
        if memo is not None and okid is not None:
            base = (okid, tuple((memo.cls[u], k) for u, k in sources), tuple(grads), copies, weights)
            kid = memo.key_id(("op", *base, rerun.key(node)))
            did = memo.key_id(("domain", *base))
        hit = memo.vars.get(kid) if memo is not None and kid is not None else None
        if hit is not None:
            strategies, compute, mem, _, op_comm, buffer = hit
        else:
            known = memo.domains.get(did) if memo is not None and did is not None else None
            if known is not None:
                strategies, plain = known
            else:
                strategies = self._strategies(node, op, sources, weights)
                plain = op_seconds(op, strategies, grads, mesh, profile, copies)
                if memo is not None and did is not None:
                    plain.flags.writeable = False
                    memo.domains[did] = (strategies, plain)
            forward = None
            if rerun.op(node.name) or has_comm(op):
                forward = memo.forwards.get(did) if memo is not None and did is not None else None
                if forward is None:
                    forward = op_seconds(op, strategies, [False] * len(grads), mesh, profile, copies)
                    if memo is not None and did is not None:
                        forward.flags.writeable = False
                        memo.forwards[did] = forward
            compute = plain + forward if forward is not None and rerun.op(node.name) else plain
            op_comm = op_comm_costs(op, strategies, grads, mesh, profile, rerun.op(node.name), forward)
            if op_comm is not None:
                compute = compute + op_comm[:, 1]
            mem, buffer = rerun.memory(node, op, strategies, mesh)
        ng = any(grads) and any(o.dtype.is_floating_point for o in op.outputs)
        self.needs_grad[node.name] = ng
        v = _add_var(g, Var(node.name, "op", strategies, compute, mem, op=op, module=_module_path(node),
                            needs_grad=ng, op_comm=op_comm, rerun_buffer=buffer))
        if memo is not None:
            if did is not None:  # what an edge reads of its consumer: the domain, not what the op keeps or reruns
                memo.key[v] = did
            if hit is not None:
                memo.cls[v] = hit[3]
            else:
                c = memo.classify(g, v)
                if kid is not None:
                    compute.flags.writeable = mem.flags.writeable = False
                    memo.vars[kid] = (strategies, compute, mem, c, op_comm, buffer)
        for i, (a, (u, k)) in enumerate(zip(targs, sources)):
            _add_edge(g, u, v, k, i, self.needs_grad.get(a.name, False), memo=memo, rerun=rerun.op(node.name),
                      lazy=returned_sum(a, node))
        for i in written:
            a = targs[i]
            if a.op != "placeholder":
                continue
            g.written.add(a.name)
            if a.name in self.cap.params or a.name in self.cap.buffers:
                _add_edge(g, g.index[a.name], v, 0, i, False, write_back=True, memo=memo)
        _add_reshard_points(g, v, self.uses, ng, fixed, memo, rerun)

    def _node(self, node: fx.Node) -> tuple[OpSpec, bool, int | None, bool, list[int]]:
        """What an op node is whatever the tilings and the recomputation: its spec, whether it has no rule (and
        reads a tensor: it runs replicated), its ``op_key`` as a key id (None: unhashable, not shared), whether it
        is a view that may copy its tile, and the inputs it writes in place.  Kept in the shared work: every build
        of a mesh's recomputation choices reads it again."""
        known = self.memo.nodes.get(node.name) if self.memo is not None else None
        if known is not None:
            return known
        op = node_spec(node)
        okey = op_key(op) if self.memo is not None else None
        facts = (op, rules.lookup(node.target) is None and bool(op.inputs),
                 self.memo.key_id(("okey", okey)) if self.memo is not None and okey is not None else None,
                 may_copy(node) if op.name in RESHAPES else False,  # a view that may copy its tile: priced
                 written_inputs(op))
        if self.memo is not None:
            self.memo.nodes[node.name] = facts
        return facts

    def _strategies(self, node: fx.Node, op: OpSpec, sources: list[tuple[int, int]],
                    weights: bool) -> list[Strategy]:
        """An op's domain: the plan's one strategy (``fixed``), or its rule's strategies on the mesh less those
        that cannot pay (``_needless_partial``) and those the options rule out (context parallelism, its method,
        ``divide_work``)."""
        g, mesh, fixed = self.g, self.mesh, self.fixed
        if fixed is not None:
            ins, outs = fixed.node_tilings(node.name) if node.name in fixed.nodes else (
                [self.full] * len(op.inputs), [self.full] * len(op.outputs))
            strategies = [Strategy(tuple(ins), tuple(outs), fixed.node_variant(node.name))]
            if strategies[0].variant and strategies[0] not in expand(op, mesh, strategies_1d(op)):
                # a variant runs another program on the same tilings: one its rule does not list would run wrong
                raise ValueError(f"the plan runs {node.name} as {strategies[0].variant!r} with tilings its rule "
                                 "has no such variant for: was the plan edited, or made by another soybean?")
            return strategies
        strategies = expand(op, mesh, strategies_1d(op))
        emits = [partial_axes(g.vars[u], k, mesh.ndim) for u, k in sources]
        strategies = [s for s in strategies if not _needless_partial(s, emits)] or strategies
        cp = self.context_parallel
        if cp != "auto" and op.name == SDPA:
            if isinstance(cp, tuple):  # a baseline's own axes
                strategies = [s for s in strategies if tuple(row_axes(op, s)) == cp]
                why = f"does not split on mesh axes {list(cp)}"
            else:
                want = 1 if cp == "none" else int(cp)
                strategies = [s for s in strategies if math.prod(mesh.shape[a] for a in row_axes(op, s)) == want]
                why = f"splits on no axes {want} ways (--context-parallel {want}): use a mesh with such axes"
            if not strategies:
                raise NoStrategyLeft(f"mesh {mesh}: attention {node.name}'s query sequence {why}")
        if self.cp_method != "auto" and op.name == SDPA:
            strategies = [s for s in strategies if cp_method(op, s) in ("", self.cp_method)]
        if (self.divide_work if self.divide_work is not None else self.objective == "comm") and not weights:
            # SoyBean: every op's work is divided; redundant compute only where nothing else is legal.  Not an op on
            # weights alone: its work has no batch to divide, and asking it to split a weight the layout keeps whole
            # is a forbidden resharding (data parallelism was "infeasible" on Cohere 2, whose norms cast their
            # weight to float32).
            whole = [s for s in strategies if all(s.divides_work())]
            strategies = whole or strategies
        return strategies

    def output(self, node: fx.Node) -> None:
        """The output: every returned tensor read whole (only scalars under the local-batch contract)."""
        leaves, _ = tree_flatten(node.args)
        returned = [o for o in leaves if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]
        if self.local_outputs:  # only scalars (losses) must be whole; other outputs stay as tiled
            returned = [o for o in returned if o.meta["val"].dim() == 0]
        if self.fixed is not None and OUTPUT in self.fixed.nodes:  # the tilings the plan chose
            sts = [Strategy(tuple(self.fixed.node_tilings(OUTPUT)[0]), ())]
        elif self.lazy_outputs and self.fixed is None:
            each = [lazy_output_tilings(tuple(o.meta["val"].shape), self.g.mesh) for o in returned]
            if math.prod(len(c) for c in each) > MAX_OUTPUT_STRATEGIES:  # read whole: priced as the gather it is
                each = [[self.full]] * len(returned)
            sts = [Strategy(tuple(c), ()) for c in itertools.product(*each)]
        else:
            sts = [Strategy(tuple(self.full for _ in returned), ())]
        n = len(sts)
        v = _add_var(self.g, Var(OUTPUT, "output", sts, np.zeros(n), np.zeros(n)))
        for i, a in enumerate(returned):
            u, k = value_source(self.g, a)
            _add_edge(self.g, u, v, k, i, self.needs_grad.get(a.name, False), lazy=returned_sum(a, node))


# The output variable's name, and the key of its tilings in a plan's ``nodes`` where any output leaves split.
OUTPUT = "output"
# The most combinations of lazy output tilings an output variable takes; past it every output is read whole.
MAX_OUTPUT_STRATEGIES = 64


def lazy_output_tilings(shape: tuple[int, ...], mesh: Mesh) -> list[tuple]:
    """The tilings a non-scalar output of ``shape`` may leave in under ``PlanOptions.outputs`` ``lazy``: every
    choice of ``R`` or ``S(0)`` per mesh axis whose split leaves every tile at least one row (the axes splitting
    dim 0 divide it, the outer first) -- the batch slices ``run.outputs.LazyFull`` computes a loss on tile by tile
    and gathers along dim 0 when read whole.  A scalar is whole."""
    if not shape:
        return [(R,) * mesh.ndim]
    out = []
    for split in itertools.product((False, True), repeat=mesh.ndim):
        if math.prod(n for n, s in zip(mesh.shape, split) if s) <= shape[0]:
            out.append(tuple(Shard(0) if s else R for s in split))
    return out


def returned_sum(value: fx.Node, consumer: fx.Node) -> bool:
    """Whether an all-reduce of ``value`` read by ``consumer`` is a returned sum, which the generated program
    starts asynchronously: ``capture.passes.mark_returned_sums`` marked ``value``, whose one reader is ``consumer``."""
    return bool(value.meta.get(RETURNED_SUM)) and consumer in value.users


@lru_cache(maxsize=16)
def backend_only(profile: Profile) -> Profile:
    """``profile`` with every collective on the backend's own call (a returned sum's: ``returned_sum``).
    Cached: pricing caches key on the profile, so one profile must stay one object."""
    return replace(profile, algorithms=("backend",))


def value_name(g: PlanGraph, vi: int) -> str:
    """How reports name the value var ``vi`` makes: a parameter's or buffer's FQN, else the var's name."""
    v = g.vars[vi]
    return v.fqn if v.kind in ("param", "buffer") else v.name


def read_profile(profile: Profile, lazy: bool) -> Profile:
    """The profile a read is priced with: the backend's calls only for a returned sum (``Edge.lazy``)."""
    return backend_only(profile) if lazy else profile


def edge_profile(g: PlanGraph, e: Edge) -> Profile:
    """The profile edge ``e`` is priced with (``read_profile``)."""
    return read_profile(g.profile, e.lazy)



def _add_var(g: PlanGraph, v: Var) -> int:
    g.index[v.name] = len(g.vars)
    g.vars.append(v)
    return len(g.vars) - 1


def _unique(keys: list) -> tuple[list, np.ndarray]:
    pos: dict = {}
    idx = np.array([pos.setdefault(k, len(pos)) for k in keys], dtype=np.int64)
    return list(pos), idx


def partial_grad_axes(s: Strategy, dst: tuple, mesh: Mesh) -> tuple[int, ...]:
    """Axes on which an op under strategy ``s`` reads an input of tiling ``dst`` replicated while it
    splits its work: each device's gradient of that input is then a partial sum (Megatron's ``f``)."""
    split = s.split_axes()
    return tuple(a for a in range(mesh.ndim) if split[a] and isinstance(dst[a], Replicate))


def _add_edge(
    g: PlanGraph, u: int, v: int, out_idx: int, in_idx: int, needs_grad: bool, write_back: bool = False,
    memo: _Memo | None = None, rerun: bool = False, lazy: bool = False,
) -> None:
    """``rerun``: the consumer's layer is recomputed, so the read's forward collectives run again in backward.
    ``lazy``: ``Edge.lazy``."""
    mkey = None
    if memo is not None and v in memo.key and u in memo.cls:
        mkey = (memo.cls[u], out_idx, memo.key[v], in_idx, needs_grad, write_back, rerun, lazy)
        if (seen := memo.edges.get(mkey)) is not None:
            g.edges.append(seen.at(u, v))
            return
    U, V = g.vars[u], g.vars[v]
    spec = V.op.inputs[in_idx] if V.op is not None else None
    if spec is None:  # output var: the producer's output spec
        spec = U.op.outputs[out_idx] if U.op is not None else None
    shape = spec.shape if spec is not None else g.shapes.get((u, out_idx), ())
    itemsize = spec.dtype.itemsize if spec is not None else g.dtypes[(u, out_idx)].itemsize
    src_keys = [(tuple(st.outputs[out_idx]), U.grad_partial[s] if U.kind == "reshard" else ())
                for s, st in enumerate(U.strategies)]
    dst_keys = []
    for t, s_dst in enumerate(V.strategies):
        dst = tuple(s_dst.inputs[in_idx])
        if V.kind == "reshard":
            pga = V.grad_partial[t]
        else:
            pga = partial_grad_axes(s_dst, dst, g.mesh) if V.kind == "op" else ()
        dst_keys.append((dst, pga))
    # Price each distinct (source tiling, target tiling) pair once; repeated layers share the table.
    us, si = _unique(src_keys)
    ud, di = _unique(dst_keys)
    profile = read_profile(g.profile, lazy)
    # The mesh and the run's profile come last: a change of either drops the cached tables (a lazy read's
    # backend-only profile must not, or every switch between lazy and plain reads would clear it).
    key = (tuple(us), tuple(ud), shape, itemsize, needs_grad, U.pinned, U.gathered, write_back, rerun, lazy,
           g.mesh, g.profile)
    cache = g.pricing

    def price() -> EdgeTables:
        ids = cache.route_ids(key[0], key[1], needs_grad, write_back)
        Bu, Tu, Su = (x.reshape(len(us), len(ud))
                      for x in price_route_ids(ids, shape, itemsize, g.mesh, profile, cache.steps))
        if rerun:  # the forward steps again (a route that needs no gradient is its forward)
            fwd = cache.route_ids(key[0], key[1], False, write_back)
            Bf, Tf, _ = (x.reshape(len(us), len(ud))
                         for x in price_route_ids(fwd, shape, itemsize, g.mesh, profile, cache.steps))
            Bu, Tu = Bu + Bf, Tu + Tf
        if U.pinned and not write_back:
            banned = np.array([[not pinned_use(src, dst, U.gathered) for dst, _ in ud] for src, _ in us])
            Bu[banned] = Tu[banned] = PINNED
            Su[banned] = 0.0
        return Bu, Tu, Su

    if g.priced:
        Bu, Tu, Su = cache.edge_tables(key, price)
    else:
        Bu = Tu = Su = np.zeros((len(us), len(ud)))
    B, T = Bu[np.ix_(si, di)], Tu[np.ix_(si, di)]
    deferred = U.kind == "param" and not write_back
    S = Su[np.ix_(si, di)] if deferred and Su.any() else None
    edge = Edge(u, v, out_idx, in_idx, B, T, shape, itemsize, needs_grad, deferred, S, write_back, rerun, lazy, us,
                si, ud, di)
    g.edges.append(edge)
    if memo is not None and mkey is not None:
        for arr in (B, T, S, si, di):
            if arr is not None:
                arr.flags.writeable = False
        memo.edges[mkey] = edge
