"""Lower the captured graph + plan into the per-rank program of one device.

The plan's choices are turned back into the planning graph (``graph.build(fixed=plan)``), which
decides every edge's semantics; lowering reads them and derives nothing.  ``Lowering`` walks the
captured graph with one method per node kind:

* ``placeholder``: parameters and buffers arrive as local tiles; a user input arrives full and is
  sliced to its planned tiling (unless the plan's contract is ``local_batch``);
* ``getitem``: picks an output of a multi-output op;
* ``op``: every tensor argument is read along its edge's ``reshard.Route`` (its steps emitted as
  the kinds table's ``sb_*`` calls; a value with several uses is resharded once, at its shared
  reshard point); shape-carrying arguments are rewritten by the rule's ``localize`` to this
  device's tile shapes (so the program is per rank: uneven tiles depend on the coordinates); a
  view whose input's tile may not allow it (``rules.views.may_copy``: the tile's layout need not be the serial
  value's) runs as a reshape; ``as_strided``, which reads storage, runs on its input laid out as the serial one
  (``runtime.layouts``); a windowed op whose strategy splits a spatial dim reads its window of rows by a
  halo exchange (``rules.window``), runs with that dim's padding 0 (the rule's ``window_args``) and keeps its
  own output rows (a ``narrow`` where it computed more); an op whose rule sums statistics across
  tiles (batch norm split along batch or space in training) calls the rule's ``sync_call``; a
  parameter or buffer an op updates in place through a resharded copy is written back along its
  write-back edge;
* ``output``: outputs leave full (``R``), or as tiles under ``local_batch``.

A parameter's own gradient all-reduce is not emitted: its axes are collected in
``meta["grad_sync"]`` for the runtime's bucketed gradient sync.  The result is an
``fx.GraphModule`` whose ``.code`` is plain Python.
"""
from __future__ import annotations

import heapq
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import rules
from ..capture.core import Captured
from ..capture.passes.mark_returned_sums import RETURNED_SUM, SCALINGS
from ..cost.profiles import load_profile
from ..graph import OUTPUT, Edge, PlanGraph, build, node_module, value_name, value_source
from ..ir.algorithms import BACKEND, Algo
from ..ir.kinds import KINDS, Step
from ..mesh import Mesh
from ..plan import Plan, Program
from ..reshard import Route, StepCall
from ..rules.views import as_reshape, may_copy
from ..rules.window import crops, halo_step, halos, local_rows, windows_of
from ..runtime import context as rt
from ..runtime.kinds import CALLS
from ..runtime.layouts import reads_within, sb_as_strided
from ..runtime.synced import SYNC_CALLS
from ..tiling import Partial, Placement, R, Shard, local_shape
from .recompute import checkpoint_layers

Tiling = tuple[Placement, ...]
ALL_REDUCE = CALLS["all_reduce"]
HALO = KINDS["halo"]


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def emit_reshard(g: fx.Graph, x: fx.Node, shape: tuple[int, ...], route: Route, mesh: Mesh, coords: tuple[int, ...],
                 defer: set[int] | None = None, view: bool = False,
                 algorithms: Callable[[Step, StepCall], Algo | None] | None = None) -> fx.Node:
    """Append the runtime calls of ``route``'s steps (the kinds table's ``call``) to ``x``: one walk of the route
    (``Route.walk``), the one pricing and the plan's records read.

    With ``defer`` (a parameter's own edge), the gradient-sync steps are not emitted but their axes
    collected: the runtime sums those parameter gradients after backward, bucketed (``GradSync``).
    ``view``: ``x`` is never written in place, so slicing it may return views.
    ``algorithms``: the algorithm the program runs each collective of this route by (``Program.algorithms`` of its
    edge: ``algo=`` forward, ``back=`` its adjoint); None, or one it does not give, runs the backend's.
    """
    for w in route.walk():
        step, kind = w.step, KINDS[w.step.kind]
        if defer is not None and kind.gradient_sync:
            if mesh.shape[step.axis] > 1:  # a group of one has nothing to sum
                defer.add(step.axis)
            continue
        after = local_shape(shape, w.after, mesh, coords)
        kwargs: dict[str, Any] = {"view": True} if view and kind.viewable else {}
        for c in w.calls if mesh.shape[step.axis] > 1 else ():
            algo = algorithms(step, c) if algorithms is not None else None
            if algo is not None and algo[0] != BACKEND:
                kwargs["back" if c.backward else "algo"] = algo
        x = g.call_function(CALLS[step.kind], (x, step.axis, *kind.args(step, after)), kwargs)
    return x


def gather_now(t: torch.Tensor, tiling: Tiling, shape: tuple[int, ...], mesh: Mesh,
               coords: tuple[int, ...]) -> torch.Tensor:
    """The full tensor of this device's tile ``t`` of ``tiling``, gathered now (the reshard to all-``R``,
    differentiable; call it under ``runtime.context.use_groups``)."""
    g = fx.Graph()
    g.output(emit_reshard(g, g.placeholder("x"), shape, Route.of(tiling, (R,) * mesh.ndim), mesh, coords))
    return fx.GraphModule(torch.nn.Module(), g)(t)


def _lazy_output_sums(g: fx.Graph) -> None:
    """Make each returned sum asynchronous (``sb_all_reduce_lazy``): the all-reduces lowering tagged
    ``RETURNED_SUM`` (the reads ``capture.passes.mark_returned_sums`` marked), which nothing in the program reads.

    A division or multiplication by a constant after the all-reduce (the mean's ``/ count``) is moved before it:
    ``(sum_k x_k) / c = sum_k (x_k / c)``, so the all-reduce is the last step and its result the returned value.
    The planning graph prices these sums as the backend's calls (``graph.Edge.lazy``), the only ones that start
    asynchronously: one the plan runs by another algorithm (``algo=``) stays as it is.
    """
    for ar in [n for n in g.nodes if n.meta.get(RETURNED_SUM)]:
        if ar.target is not ALL_REDUCE or "algo" in ar.kwargs or len(ar.users) != 1:
            continue
        (a,) = ar.users
        if a.op == "output":
            ar.target = rt.sb_all_reduce_lazy
        elif a.target in SCALINGS and a.args[0] is ar and len(a.users) == 1 and next(iter(a.users)).op == "output":
            scale = a.target
            assert callable(scale)  # one of SCALINGS
            x, axis = ar.args
            with g.inserting_before(a):
                scaled = g.call_function(scale, (x, a.args[1]))
                lazy = g.call_function(rt.sb_all_reduce_lazy, (scaled, axis))
            a.replace_all_uses_with(lazy)
            g.erase_node(a)
            g.erase_node(ar)


def walk_order(cap: Captured, program: Program) -> list[fx.Node]:
    """The captured graph's nodes in the order the plan's graph listed its ops (``Plan.keys``, matched by structural
    key: ``Plan.aligned``), so that every rank emits its collectives in one order.

    Each process captures a model's independent computations in the order its forward runs them, which Python's
    ``set`` iteration can change between processes (ModernBERT's rotary tables per layer type); two ranks walking
    their own orders would pair one's all-gather of one table with the other's of the other.  The order is a
    topological sort of the local graph by the plan's positions (a ``getitem`` right after its producer, local
    order between equals); placeholders stay first in local order (the program's signature), the output last."""
    nodes = list(cap.graph.nodes)
    pos = {n: i for i, (n, _) in enumerate(program.aligned(cap.keys).keys)}
    ops = [n for n in nodes if n.op == "call_function"]
    planned = [pos[n.name] for n in ops if n.name in pos]
    if planned == sorted(planned):
        return nodes  # already the plan's order
    index = {n: i for i, n in enumerate(nodes)}

    def priority(n: fx.Node) -> tuple[float, int]:
        src = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else n
        return (pos.get(src.name, pos.get(n.name, float(index[n]))) + (0.5 if src is not n else 0.0), index[n])

    waiting = {n: sum(1 for a in n.all_input_nodes if a.op == "call_function") for n in ops}
    ready = [(priority(n), n.name, n) for n in ops if not waiting[n]]
    heapq.heapify(ready)
    out: list[fx.Node] = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for u in n.users:
            if u in waiting:
                waiting[u] -= 1
                if not waiting[u]:
                    heapq.heappush(ready, (priority(u), u.name, u))
    return [n for n in nodes if n.op == "placeholder"] + out + [n for n in nodes if n.op == "output"]


class Lowering:
    """One rank's program for ``plan``: placeholders as in ``cap`` (params and buffers as local tiles)."""

    def __init__(self, cap: Captured, plan: Plan | Program, rank: int, tile_outputs: bool = False,
                 summed_per_use: frozenset[str] = frozenset()) -> None:
        # Parameters whose partial gradients are summed in the program's backward, each use's own contribution, not
        # deferred to the runtime's bucketed sync of the accumulated gradient: the model's own parameter objects
        # (``share_params``), whose ``grad`` may also accumulate what other programs and the user's code add
        # (a parameter read by two pieces of a dynamo capture, ``soybean.run.pieces``): only a sum per use stays exact.
        self.summed_per_use = summed_per_use
        # What runs, named as this capture names its nodes: the record (cost, baselines, ...) is never read.
        self.prog = prog = (plan.program if isinstance(plan, Plan) else plan).aligned(cap.keys)
        self.cap, self.rank = cap, rank
        # Non-scalar outputs leave as produced (partial sums reduced, splits kept) under the local-batch
        # contract, and under the full-batch one when the module gathers them lazily (``soybean.run.outputs``).
        self.tile_outputs = tile_outputs or prog.local_batch
        self.output_tilings: list[Tiling | None] = []  # per flat output: its tiling when left split
        self.mesh = Mesh(prog.mesh)
        self.coords = self.mesh.coords(rank)
        self.full: Tiling = (R,) * self.mesh.ndim
        # The plan's graph: one strategy per var, the edge semantics decided there (its routes; never priced).
        self.pg: PlanGraph = build(cap, self.mesh, load_profile(None), fixed=prog, priced=False)
        self.into: dict[int, list[Edge]] = {}        # the edges a var reads, by input index
        self.write_backs: dict[int, list[Edge]] = {}  # the stored tensors an op updates in place
        for e in self.pg.edges:
            (self.write_backs if e.write_back else self.into).setdefault(e.dst, []).append(e)
        for es in self.into.values():
            es.sort(key=lambda e: e.dst_in)
        self.g = fx.Graph()
        self.env: dict[str, Any] = {}                       # captured node -> lowered node
        self.values: dict[tuple[int, int], fx.Node] = {}    # (var, output) -> its lowered value, as produced
        self.shared: dict[int, fx.Node] = {}                # reshard point var -> its value, emitted once
        self.grad_sync: dict[str, set[int]] = {}            # parameter FQN -> axes its gradient is summed over
        self.readonly: set[fx.Node] = set()                 # lowered values of placeholders nothing writes

    def run(self) -> fx.GraphModule:
        for node in walk_order(self.cap, self.prog):
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "call_function" and node.target is operator.getitem:
                self.getitem(node)
            elif node.op == "call_function":
                self.op(node)
            elif node.op == "output":
                self.output(node)
            self._tag(node_module(node) if node.op == "call_function" else "")
        _lazy_output_sums(self.g)
        gm = fx.GraphModule(torch.nn.Module(), self.g, class_name=f"Rank{self.rank}Program")
        gm.meta["grad_sync"] = {k: tuple(sorted(v)) for k, v in self.grad_sync.items() if v}
        gm.meta["output_tilings"] = self.output_tilings
        return checkpoint_layers(gm, self.prog.recompute)

    def _tag(self, module: str) -> None:
        """Mark the nodes just emitted (an op, the reshards of its inputs) with the module of the op they lower."""
        for n in reversed(self.g.nodes):
            if "module" in n.meta:
                break
            n.meta["module"] = module

    # ---- reading values along edges ----

    def chosen(self, e: Edge) -> Callable[[Step, StepCall], Algo | None]:
        """The algorithm this program runs each collective of edge ``e``'s route by (``Program.algorithms``)."""
        tensor, to, algos = value_name(self.pg, e.src), self.pg.vars[e.dst].name, self.prog.algorithms
        return lambda step, c: algos.get((tensor, to, str(step), c.collective, c.phase))

    def value(self, u: int, k: int) -> fx.Node:
        """Output ``k`` of var ``u`` as the consumers of ``u`` read it (a reshard point's, emitted once)."""
        if self.pg.vars[u].kind == "reshard":
            if u not in self.shared:
                self.shared[u] = self.read(self.into[u][0])
            return self.shared[u]
        return self.values[(u, k)]

    def read(self, e: Edge) -> fx.Node:
        """The value edge ``e``'s consumer reads: its source's value moved along the edge's route."""
        U, V = self.pg.vars[e.src], self.pg.vars[e.dst]
        defer = self.grad_sync.setdefault(U.fqn, set()) if e.deferred and U.fqn not in self.summed_per_use else None
        x = self.value(e.src, e.src_out)
        # An op's slices of a placeholder's value that nothing writes may alias it.
        view = V.kind == "op" and x in self.readonly
        out = emit_reshard(self.g, x, e.shape, e.route(0, 0), self.mesh, self.coords, defer=defer, view=view,
                           algorithms=self.chosen(e))
        if e.lazy and out is not x:
            out.meta[RETURNED_SUM] = True
        return out

    # ---- one method per node kind ----

    def placeholder(self, node: fx.Node) -> None:
        ph = self.g.placeholder(node.name)
        ph.meta.update(node.meta)
        self.env[node.name] = ph
        vi = self.pg.index.get(node.name)
        if vi is None:  # unused, or not a tensor
            return
        v = self.pg.vars[vi]
        tiling = v.strategies[0].outputs[0]
        if v.kind == "input" and not self.prog.local_batch:  # full inputs arrive on every rank: keep my tile
            x = emit_reshard(self.g, ph, tuple(_val(node).shape), Route.of(self.full, tiling), self.mesh, self.coords,
                             view=node.name not in self.pg.written)
            self.env[node.name] = x
        self.values[(vi, 0)] = self.env[node.name]
        if node.name not in self.pg.written:
            self.readonly.add(self.env[node.name])

    def getitem(self, node: fx.Node) -> None:
        src, idx = node.args
        assert isinstance(src, fx.Node) and isinstance(idx, int)
        self.env[node.name] = self.g.call_function(operator.getitem, (self.env[src.name], idx))
        if src.name in self.pg.index:
            self.values[(self.pg.index[src.name], int(idx))] = self.env[node.name]

    def op(self, node: fx.Node) -> None:
        vi = self.pg.index[node.name]
        v = self.pg.vars[vi]
        op, st = v.op, v.strategies[0]
        assert op is not None
        edges = iter(self.into.get(vi, []))
        reads: list[fx.Node] = []  # per tensor input, in order: the value the op reads
        split = halos(windows_of(op), st)  # windowed dims this strategy splits: their halo exchanges

        def arg(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            if not isinstance(_val(a), torch.Tensor):
                return self.env[a.name]
            reads.append(self.read(next(edges)))
            x = reads[-1]
            for axis, w in split:
                if w.slot == len(reads) - 1:
                    step = halo_step(w, axis, self.mesh)
                    x = self.g.call_function(CALLS["halo"], (x, axis, *HALO.args(step, ())))
            return x

        args, kwargs = tree_map(arg, (tuple(node.args), dict(node.kwargs)))
        entry = rules.lookup(node.target)
        if entry is not None and entry.localize is not None:
            in_shapes = [local_shape(s.shape, t, self.mesh, self.coords) for s, t in zip(op.inputs, st.inputs)]
            out_shapes = [local_shape(s.shape, t, self.mesh, self.coords) for s, t in zip(op.outputs, st.outputs)]
            args, kwargs = entry.localize(op, args, kwargs, in_shapes, out_shapes)
        if split and entry is not None and entry.window_args is not None:
            args, kwargs = entry.window_args(op, args, kwargs, local_rows(split, self.mesh, self.coords))
        target = node.target
        if as_reshape(target) is not None and may_copy(node):
            # A view whose input's tile may be laid out so that no view exists (``rules.views.may_copy``): run as
            # the reshape of the same meaning, a view where the tile allows one, else the priced copy.
            target = as_reshape(target)
        if target is torch.ops.aten.as_strided.default and self.mesh.size > 1:  # one device holds serial's value
            target, kwargs = sb_as_strided, {**kwargs, **_serial_layout(node)}
        sync = entry.sync_args(op, st) if entry is not None and entry.sync_args is not None else {}
        if sync and entry is not None and entry.sync_call is not None:  # statistics summed across tiles
            target, kwargs = SYNC_CALLS[entry.sync_call], {**kwargs, **sync}
        assert callable(target)  # a call_function node's target is the function
        if split:  # it saves its halo windows as their halo rows (the tile is kept anyway)
            fn: Any = target  # an OpOverload or a function: passed to the runtime call as a constant
            out = self.g.call_function(rt.sb_windowed, (fn, *args), dict(kwargs))
        else:
            out = self.g.call_function(target, tuple(args), dict(kwargs))
        out.name = node.name
        for dim, start, length in crops(split, self.mesh, self.coords):  # the op ran on more rows than mine
            out = self.g.call_function(torch.ops.aten.narrow.default, (out, dim, start, length))
        for e in self.write_backs.get(vi, []):
            tile, x = self.values[(e.src, 0)], reads[e.dst_in]
            if x is not tile:  # the op updated a resharded copy: copy it back into the stored tile
                self.g.call_function(torch.ops.aten.copy_.default,
                                     (tile, emit_reshard(self.g, x, e.shape, e.route(0, 0), self.mesh, self.coords,
                                                         algorithms=self.chosen(e))))
        self.env[node.name] = out
        self.values[(vi, 0)] = out

    def _batch_tiling(self, shape: tuple[int, ...]) -> Tiling | None:
        """Under ``local_batch``, the tiling a batch output leaves in: the first input's (each rank passed its
        rows, ``ParallelModule.local_slice``), when the output has that batch (dim 0) and the input is split only
        along it; else None."""
        if not self.prog.local_batch or not self.cap.inputs or self.cap.inputs[0] not in self.prog.inputs:
            return None
        first = next(n for n in self.cap.graph.nodes if n.op == "placeholder" and n.name == self.cap.inputs[0])
        val = first.meta.get("val")
        tiling = self.prog.input_tiling(self.cap.inputs[0])
        if not isinstance(val, torch.Tensor) or not shape or val.dim() == 0 or shape[0] != val.shape[0] \
                or any(isinstance(p, Shard) and p.dim != 0 for p in tiling):
            return None
        return tiling

    def output(self, node: fx.Node) -> None:
        flat, spec = tree_flatten(node.args[0])
        out_var = self.pg.vars[self.pg.index[OUTPUT]]
        edges = iter(self.into.get(self.pg.index[OUTPUT], []))
        planned = OUTPUT in self.prog.nodes  # a plan that left some output split along dim 0 (``outputs`` lazy)
        res: list[Any] = []
        for a in flat:
            v = _val(a)
            tiling: Tiling | None = None
            if not isinstance(a, fx.Node):
                res.append(a)
            elif not isinstance(v, torch.Tensor):
                res.append(self.env[a.name])
            elif not self.tile_outputs or v.dim() == 0 or (not self.prog.local_batch and planned):
                e = next(edges)
                res.append(self.read(e))  # in the tiling planned for it: whole, or split along dim 0 (lazy)
                want = out_var.strategies[0].inputs[e.dst_in]
                if _split(want, self.mesh):
                    if self.tile_outputs:  # left split for ``run.outputs.LazyFull``, as the plan priced it
                        tiling = want
                    else:  # this module returns full tensors: the gather the lazy plan left to the loop, here
                        route = Route.of(want, self.full, (), (), e.needs_grad)
                        res[-1] = emit_reshard(self.g, res[-1], tuple(v.shape), route, self.mesh, self.coords)
            else:  # returned as a tile: only pending sums are reduced
                if not self.prog.local_batch:
                    # A plan that priced the gather to the full output (``outputs`` ``full``, or saved before the
                    # option): the gather left to the module (``soybean.run.outputs``), the output as produced.
                    next(edges)
                u, k = value_source(self.pg, a)
                U = self.pg.vars[u]
                src = U.strategies[0].outputs[k]
                # The local-batch contract: a batch output comes back as the input's rows.
                batch = self._batch_tiling(tuple(v.shape))
                dst: Tiling = batch if batch is not None else tuple(R if isinstance(p, Partial) else p for p in src)
                route = Route.of(src, dst, (), U.grad_partial[0] if U.kind == "reshard" else (), U.needs_grad)
                x = self.value(u, k)
                res.append(emit_reshard(self.g, x, tuple(v.shape), route, self.mesh, self.coords))
                if a.meta.get(RETURNED_SUM) and res[-1] is not x:
                    res[-1].meta[RETURNED_SUM] = True
                tiling = dst if _split(dst, self.mesh) else None
            self.output_tilings.append(tiling)
        self.g.output(tree_unflatten(res, spec))


def _serial_layout(node: fx.Node) -> dict[str, Any]:
    """What ``runtime.layouts.sb_as_strided`` needs of ``as_strided`` node ``node``'s input to read what the serial
    run read: its strides and storage offset there.  A ``ValueError`` where the serial op reads storage outside the
    input's own elements (a view into a larger tensor): no program holding only that value can read it."""
    x = _val(node.args[0])
    size, stride = [int(n) for n in node.args[1]], [int(n) for n in node.args[2]]  # type: ignore[union-attr, arg-type]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    read = int(x.storage_offset() if offset is None else offset)  # type: ignore[arg-type]
    if not reads_within(tuple(x.shape), tuple(x.stride()), x.storage_offset(), size, stride, read):
        raise ValueError(
            f"{node.name}: as_strided reads storage outside its input {node.args[0]} (shape {tuple(x.shape)}, "
            f"strides {tuple(x.stride())}), the memory of a larger tensor it is a view of; a split program cannot "
            "read it. Fix: index the tensor itself (unfold, a slice) rather than its storage, or plan on 1 device")
    return {"serial_stride": tuple(x.stride()), "serial_offset": x.storage_offset()}


def _split(t: Tiling, mesh: Mesh) -> bool:
    """Whether tiling ``t`` cuts its tensor: some mesh axis of more than one device shards it."""
    return any(isinstance(p, Shard) and n > 1 for p, n in zip(t, mesh.shape))


def lower(cap: Captured, plan: Plan | Program, rank: int, tile_outputs: bool = False,
          summed_per_use: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Rank ``rank``'s program for ``plan`` (see ``Lowering``); ``tile_outputs``: split non-scalar outputs are
    returned as tiles, their tilings in ``meta["output_tilings"]``, not gathered (``soybean.run.outputs``);
    ``summed_per_use``: parameters whose partial gradients the program sums itself, per use (``Lowering``)."""
    return Lowering(cap, plan, rank, tile_outputs, summed_per_use).run()


def emit_files(model: torch.nn.Module, inputs: tuple, plan: Plan, out_dir: str | Path) -> list[Path]:
    """Write ``rank{r}.py`` (the readable per-rank program) for every rank of ``plan``."""
    from ..capture.core import capture

    cap = capture(model, inputs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(plan.devices):
        gm = lower(cap, plan, r)
        p = out / f"rank{r}.py"
        coords = Mesh(tuple(plan.mesh)).coords(r)
        p.write_text(f"# soybean per-rank program: rank {r} of mesh {plan.mesh}, coordinates {coords}\n" + gm.code)
        paths.append(p)
    return paths
