"""Lower the captured graph + plan into the per-rank program of one device.

Every op runs on local tiles; before an op, each tensor argument whose tiling
(as produced) differs from the tiling the op's strategy takes gets the steps of
``reshard.plan_reshard`` as ``sb_*`` calls (a parameter or buffer that an op
updates in place through such a resharded copy is written back to its stored
tile afterwards); shape-carrying arguments are rewritten by the rule's ``localize`` to this device's tile shapes (which is
why the program is per rank: with uneven chunks tile shapes depend on the
coordinates).  User inputs arrive full (``R``) and are sliced; outputs leave
full (``R``).  The result is an ``fx.GraphModule`` whose ``.code`` is plain
Python.
"""
from __future__ import annotations

import operator
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from .. import rules
from ..capture import Captured
from ..graph import reshard_point_name
from ..mesh import Mesh
from ..plan import Plan
from ..reshard import apply_step, plan_reshard
from ..rules._common import Args
from ..rules.base import OpSpec, Strategy, make_opspec
from ..runtime import context as rt
from ..tiling import Partial, Placement, R, Replicate, local_shape, parse_placement

Tiling = tuple[Placement, ...]


def _tiling(strs: list[str]) -> Tiling:
    return tuple(parse_placement(s) for s in strs)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def emit_reshard(g: fx.Graph, x: fx.Node, shape: tuple[int, ...], src: Tiling, dst: Tiling, partial_grad_axes: tuple[int, ...], mesh: Mesh, coords: tuple[int, ...],
                 src_partial_axes: tuple[int, ...] = (), defer: set[int] | None = None, view: bool = False) -> fx.Node:
    """Append the collective calls turning ``x`` (tiling ``src``) into ``dst``.

    With ``defer`` (a parameter's own edges), gradient all-reduces are not emitted but their axes
    collected: the runtime sums those parameter gradients after backward, bucketed (``GradSync``).
    ``view``: ``x`` is never written in place, so slicing it may return views.
    """
    cur = src
    for step in plan_reshard(src, dst, partial_grad_axes, src_partial_axes):
        if defer is not None and step.kind == "grad_all_reduce":
            defer.add(step.axis)
            continue
        nxt = apply_step(cur, step)
        after = local_shape(shape, nxt, mesh, coords)
        k, a = step.kind, step.axis
        if k == "all_gather":
            x = g.call_function(rt.sb_all_gather, (x, a, step.dim, after[step.dim], step.grad_partial))
        elif k == "shard":
            x = g.call_function(rt.sb_shard, (x, a, step.dim), {"view": True} if view else {})
        elif k == "all_reduce":
            x = g.call_function(rt.sb_all_reduce, (x, a))
        elif k == "reduce_scatter":
            x = g.call_function(rt.sb_reduce_scatter, (x, a, step.dim))
        elif k == "all_to_all":
            x = g.call_function(rt.sb_all_to_all, (x, a, step.dim, step.dim2, after[step.dim]))
        elif k == "to_partial":
            x = g.call_function(rt.sb_to_partial, (x, a))
        elif k == "grad_all_reduce":
            x = g.call_function(rt.sb_grad_all_reduce, (x, a))
        elif k == "grad_to_partial":
            x = g.call_function(rt.sb_grad_to_partial, (x, a))
        else:  # pragma: no cover - plan_reshard only makes the kinds above
            raise AssertionError(k)
        cur = nxt
    return x


def _batch_norm_writes(a: Args) -> tuple[str, ...]:
    return ("running_mean", "running_var") if a["training"] else ()


# Ops that write into arguments their schema does not mark as written (``Tensor(a!)``):
# ``aten.batch_norm`` updates its running statistics in place in training mode.
HIDDEN_WRITES: dict[str, Callable[[Args], tuple[str, ...]]] = {"aten.batch_norm.default": _batch_norm_writes}


def written_inputs(op: OpSpec) -> list[int]:
    """Indices into ``op.inputs`` of the tensors the op writes in place."""
    schema = getattr(op.target, "_schema", None)
    names = [x.name for x in schema.arguments if x.alias_info is not None and x.alias_info.is_write] if schema is not None else []
    a = Args(op)
    if op.name in HIDDEN_WRITES:
        names += HIDDEN_WRITES[op.name](a)
    return [a.slots[n] for n in names if isinstance(a.slots.get(n), int)]


def write_back(g: fx.Graph, stored: fx.Node, updated: fx.Node, shape: tuple[int, ...], used: Tiling, kept: Tiling, mesh: Mesh, coords: tuple[int, ...]) -> None:
    """Copy a state tensor an op updated in place, in tiling ``used``, into its stored tile (tiling ``kept``).

    When the op read a resharded copy of a parameter or buffer (batch norm's running statistics,
    stored whole and updated channel-split), the update would otherwise be lost with the copy.
    """
    g.call_function(torch.ops.aten.copy_.default, (stored, emit_reshard(g, updated, shape, used, kept, (), mesh, coords)))


_SCALINGS = (torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor)


def _lazy_output_sums(g: fx.Graph) -> None:
    """Make the last all-reduce before an output asynchronous (``sb_all_reduce_lazy``).

    Nothing downstream reads a returned value, so its sum (the loss, made whole at the end of
    forward) can arrive while backward runs.  A division or multiplication by a constant after
    the all-reduce (the mean's ``/ count``) is moved before it: ``(sum_k x_k) / c = sum_k (x_k / c)``,
    so the all-reduce is the last step and its result the returned value.
    """
    out = next(n for n in g.nodes if n.op == "output")
    for a in tree_flatten(out.args)[0]:
        if not isinstance(a, fx.Node) or len(a.users) != 1:
            continue
        if a.target is rt.sb_all_reduce:
            a.target = rt.sb_all_reduce_lazy
            continue
        ar = a.args[0] if a.target in _SCALINGS and len(a.args) == 2 and not a.kwargs else None
        if isinstance(ar, fx.Node) and ar.target is rt.sb_all_reduce and len(ar.users) == 1 and isinstance(a.args[1], (int, float)):
            x, axis = ar.args
            with g.inserting_before(a):
                scaled = g.call_function(a.target, (x, a.args[1]))
                lazy = g.call_function(rt.sb_all_reduce_lazy, (scaled, axis))
            a.replace_all_uses_with(lazy)
            g.erase_node(a)
            g.erase_node(ar)


def _written_placeholders(cap: Captured) -> set[str]:
    """Names of the placeholders some op of ``cap`` writes in place."""
    out: set[str] = set()
    for node in cap.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            op = make_opspec(node.target, node.args, node.kwargs, _val(node))
            ins = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)]
            out.update(ins[k].name for k in written_inputs(op) if k < len(ins) and ins[k].op == "placeholder")
    return out


def lower(cap: Captured, plan: Plan, rank: int) -> fx.GraphModule:
    """Rank ``rank``'s program for ``plan``: placeholders as in ``cap`` (params and buffers as local tiles)."""
    mesh = Mesh(tuple(plan.mesh))
    coords = mesh.coords(rank)
    full = (R,) * mesh.ndim
    g = fx.Graph()
    env: dict[str, Any] = {}
    tiles: dict[str, list[Tiling]] = {}
    shared: dict[str, tuple[fx.Node, Tiling, tuple[int, ...]]] = {}  # reshard point -> (node, tiling, grad-partial axes)
    grad: dict[str, bool] = {}  # does the value need a gradient (as graph.build decides)? else no grad_* steps
    grad_sync: dict[str, set[int]] = {}  # parameter FQN -> mesh axes its gradient is summed over
    written = _written_placeholders(cap)  # inputs an op updates in place: sliced by copy, not by view

    def defer_for(a: fx.Node) -> set[int] | None:
        return grad_sync.setdefault(cap.params[a.name], set()) if a.op == "placeholder" and a.name in cap.params else None

    def source(a: fx.Node, shape: tuple[int, ...]) -> tuple[Any, Tiling, tuple[int, ...]]:
        """The value a consumer reads: the producer's, or its shared reshard point (emitted once)."""
        src, k = (a.args[0], int(a.args[1])) if a.op == "call_function" and a.target is operator.getitem else (a, 0)
        rp = reshard_point_name(src.name, k)
        if rp not in plan.nodes:
            return env[a.name], tiles[a.name][0], ()
        if rp not in shared:
            rec = plan.nodes[rp]
            t = _tiling(rec["out"][0])
            axes = tuple(rec.get("grad_partial", [[]])[0])
            shared[rp] = (emit_reshard(g, env[a.name], shape, tiles[a.name][0], t, axes, mesh, coords, defer=defer_for(a)), t, axes)
        return shared[rp]
    for node in cap.graph.nodes:
        if node.op == "placeholder":
            ph = g.placeholder(node.name)
            ph.meta.update(node.meta)
            env[node.name] = ph
            fqn = cap.params.get(node.name) or cap.buffers.get(node.name)
            v = _val(node)
            grad[node.name] = node.name in cap.params and isinstance(v, torch.Tensor) and v.is_floating_point()
            if fqn is not None:
                tiles[node.name] = [_tiling(plan.params[fqn]) if fqn in plan.params else full]
            elif node.name in plan.inputs and isinstance(_val(node), torch.Tensor):
                want = _tiling(plan.inputs[node.name])
                if not plan.local_batch:  # full inputs arrive on every rank: keep my tile
                    env[node.name] = emit_reshard(g, ph, tuple(_val(node).shape), full, want, (), mesh, coords, view=node.name not in written)
                tiles[node.name] = [want]
            else:
                tiles[node.name] = [full]
        elif node.op == "call_function" and node.target is operator.getitem:
            src, idx = node.args
            env[node.name] = g.call_function(operator.getitem, (env[src.name], idx))
            grad[node.name] = grad.get(src.name, False)
            tiles[node.name] = [tiles[src.name][idx]]
        elif node.op == "call_function":
            if node.name in plan.nodes:
                ins, outs = plan.node_tilings(node.name)
            else:  # not in the plan (e.g. unused): run replicated
                ins, outs = None, None
            op = make_opspec(node.target, node.args, node.kwargs, _val(node))
            if ins is None:
                ins = [full] * len(op.inputs)
                outs = [full] * len(op.outputs)
            st = Strategy(tuple(ins), tuple(outs))
            split = st.split_axes()
            i = 0
            passed: list[tuple[fx.Node, fx.Node]] = []  # per tensor input: (graph value, what the op reads)

            def arg(a: Any) -> Any:
                nonlocal i
                if isinstance(a, fx.Node):
                    v = _val(a)
                    if isinstance(v, torch.Tensor):
                        dst = ins[i]
                        x, src, spa = source(a, tuple(v.shape))
                        pga = tuple(ax for ax in range(mesh.ndim) if split[ax] and isinstance(dst[ax], Replicate)) if grad.get(a.name) else ()
                        i += 1
                        direct = x is env[a.name]
                        view = direct and a.op == "placeholder" and a.name not in written  # slices of a read-only input may alias it
                        passed.append((a, emit_reshard(g, x, tuple(v.shape), src, dst, pga, mesh, coords, spa, defer=defer_for(a) if direct else None,
                                                       view=view)))
                        return passed[-1][1]
                    return env[a.name]
                return a

            args, kwargs = tree_map(arg, (tuple(node.args), dict(node.kwargs)))
            entry = rules.lookup(node.target)
            if entry is not None and entry.localize is not None:
                in_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.inputs, ins)]
                out_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.outputs, outs)]
                args, kwargs = entry.localize(op, args, kwargs, in_shapes, out_shapes)
            out = g.call_function(node.target, tuple(args), dict(kwargs))
            out.name = node.name
            for k in written_inputs(op):
                a, x = passed[k]
                if x is not env[a.name] and (a.name in cap.buffers or a.name in cap.params):
                    write_back(g, env[a.name], x, tuple(_val(a).shape), ins[k], tiles[a.name][0], mesh, coords)
            env[node.name] = out
            tiles[node.name] = list(outs)
            leaves, _ = tree_flatten((node.args, node.kwargs))
            outs_float = any(isinstance(o, torch.Tensor) and o.is_floating_point() for o in tree_flatten(_val(node))[0])
            grad[node.name] = outs_float and any(grad.get(a.name, False) for a in leaves if isinstance(a, fx.Node))
        elif node.op == "output":
            flat, spec = tree_flatten(node.args[0])
            res = []
            for a in flat:
                if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor):
                    x, src, spa = source(a, tuple(_val(a).shape))
                    # the local-batch contract returns tiles: only pending sums are reduced
                    dst = full if not plan.local_batch or _val(a).dim() == 0 else tuple(R if isinstance(p_, Partial) else p_ for p_ in src)
                    res.append(emit_reshard(g, x, tuple(_val(a).shape), src, dst, (), mesh, coords, spa))
                elif isinstance(a, fx.Node):
                    res.append(env[a.name])
                else:
                    res.append(a)
            from torch.utils._pytree import tree_unflatten

            g.output(tree_unflatten(res, spec))
    _lazy_output_sums(g)
    gm = fx.GraphModule(torch.nn.Module(), g, class_name=f"Rank{rank}Program")
    gm.meta["grad_sync"] = {k: tuple(sorted(v)) for k, v in grad_sync.items() if v}
    return gm


def emit_files(model: torch.nn.Module, inputs: tuple, plan: Plan, out_dir: str | Path) -> list[Path]:
    """Write ``rank{r}.py`` (the readable per-rank program) for every rank of ``plan``."""
    from ..capture import capture

    cap = capture(model, inputs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(plan.devices):
        gm = lower(cap, plan, r)
        p = out / f"rank{r}.py"
        p.write_text(f"# soybean per-rank program: rank {r} of mesh {plan.mesh}, coordinates {Mesh(tuple(plan.mesh)).coords(r)}\n" + gm.code)
        paths.append(p)
    return paths
