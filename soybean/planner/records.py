"""The plan's record rows, built from a solved candidate table: what the planner found out, apart from what runs.

``to_plan`` (``planner``) writes them into the plan: ``reshard_records`` (every collective the reshard steps run,
with its algorithm: ``Plan.reshards``), ``memory_breakdown`` (the modelled peak by what holds it: ``Plan.memory``)
and ``layer_rows`` (one row per module for the report: ``Plan.layers``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .. import rules
from ..cost.collectives import choose, route_calls
from ..cost.memory import PARAM_COPIES, stored_bytes, sync_bucket_bytes
from ..graph import Edge, PlanGraph, edge_profile, layer_of, phase_peaks, rerun_freed, value_name
from ..ir.attention import SDPA, ZIGZAG
from ..ir.experts import OP as ROUTED_EXPERTS
from ..mesh import Mesh
from ..reshard import Step, phase
from ..rules.attention import cp_method, row_axes, zigzag_layout
from ..rules.base import OpSpec, Strategy
from ..rules.experts import expert_axes, ffn_axes
from ..rules.window import halo_step, halos, windows_of
from ..search import Solution
from ..tiling import fmt


def reshard_records(g: PlanGraph, choice: Sequence[int]) -> list[dict[str, Any]]:
    """Every collective the plan's reshard steps run, forward and backward, with the algorithm it runs
    (``cost.collectives.choose`` under the graph's profile): ``tensor`` (the value), ``to`` (its consumer),
    ``step``, ``collective``, ``phase``, mesh ``axis``, ``group_size``, message ``bytes``, ``algorithm``,
    ``chunks`` (lp's) and modelled ``seconds``.  A generated program runs each (``Plan.algorithms``); the
    deferred gradient sync is the backend's.  Deduplicated, in edge order."""
    out: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for e in g.edges:
        route = e.route(choice[e.src], choice[e.dst])
        tensor = value_name(g, e.src)
        for c in route_calls(route, e.shape, e.itemsize, g.mesh):
            p = g.mesh.shape[c.step.axis]
            pick = choose(c.collective, c.m, p, c.step.axis, edge_profile(g, e), c.sync)
            rec = {"tensor": tensor, "to": g.vars[e.dst].name, "step": str(c.step), "collective": c.collective,
                   "phase": phase(c.backward), "axis": c.step.axis, "group_size": p,
                   "bytes": int(c.m), "algorithm": pick.algorithm, "chunks": pick.chunks,
                   "seconds": float(f"{pick.seconds:.6g}")}
            key = tuple(rec.values())
            if key not in seen:
                seen.add(key)
                out.append(rec)
    return out


def memory_breakdown(g: PlanGraph, sol: Solution) -> dict[str, float]:
    """The modelled per-device peak (``cost.memory``) by what holds it: a parameter's term is its tile
    (``parameters``; under a mixed policy its master and its compute copy), its gradient's, AdamW's two
    states (``PARAM_COPIES`` in all, of the master) and, on the largest
    parameter, the step's temporaries; inputs and buffers their tiles; ops what they keep for backward.
    A recomputed unit's activations while it reruns (one unit at a time), less what is freed by then
    (``graph.rerun_freed``), are ``recompute_buffers``; ``collective_buffers`` are the gradient-sync buckets
    (``cost.memory.sync_bucket_bytes``; a reshard's transient buffers are not modelled)."""
    out = dict.fromkeys(("parameters", "gradients", "optimizer_states", "optimizer_temporaries", "activations",
                         "backward_transient", "inputs_and_buffers", "recompute_buffers", "collective_buffers"), 0.0)
    for vi, (v, c) in enumerate(zip(g.vars, sol.choice)):
        mem = float(v.memory[c])
        if v.kind == "param":
            shape, tiling, itemsize = g.shapes[(vi, 0)], [v.strategies[c].outputs[0]], g.dtypes[(vi, 0)].itemsize
            master = g.master_itemsize if v.needs_grad and g.master_itemsize else 0
            tile = float(stored_bytes(shape, master or itemsize, tiling, g.mesh, 1)[0])
            working = float(stored_bytes(shape, itemsize, tiling, g.mesh, 1)[0]) if master else 0.0
            sync = float(sync_bucket_bytes(shape, itemsize, tiling, g.mesh)[0]) if v.needs_grad else 0.0
            out["parameters"] += tile + working  # a mixed policy's master and its compute copy
            out["gradients"] += tile
            out["optimizer_states"] += (PARAM_COPIES - 2) * tile
            out["collective_buffers"] += sync
            out["optimizer_temporaries"] += mem - PARAM_COPIES * tile - working - sync
        elif v.kind in ("buffer", "input"):
            out["inputs_and_buffers"] += mem
        else:
            rerun = float(v.rerun_buffer[c]) if v.rerun_buffer is not None else 0.0
            transient = float(v.transient[c]) if v.transient is not None else 0.0
            out["activations"] += mem - rerun - transient
            out["recompute_buffers"] += rerun
            out["backward_transient"] += transient
    out["recompute_buffers"] -= rerun_freed(g, sol.choice)
    out["activation_phase"], out["gradient_phase"] = phase_peaks(g, sol.choice)
    out["peak"] = max(out["activation_phase"], out["gradient_phase"])
    return out


def edge_steps(g: PlanGraph, e: Edge, sol: Solution) -> list[Step]:
    """The collective steps one edge runs under the solution (as codegen emits them)."""
    return e.route(sol.choice[e.src], sol.choice[e.dst]).steps()


def layer_rows(g: PlanGraph, sol: Solution) -> list[dict[str, Any]]:
    """One row per module (innermost ``nn.Module`` path), in graph order: its weight's tiling, the
    tilings entering and leaving it, and every collective on an edge into one of its ops or shared
    reshard points, with the bytes they move per device per step (forward + backward)."""
    rows: dict[str, dict[str, Any]] = {}
    for e in g.edges:
        V = g.vars[e.dst]
        if V.kind not in ("op", "reshard"):
            continue
        key = V.module or V.name
        row = rows.setdefault(key, {"layer": key, "op": "", "node": "", "weight": "-", "input": "", "output": "",
                                    "collectives": [], "bytes": 0.0})
        U = g.vars[e.src]
        st = V.strategies[sol.choice[e.dst]]
        if V.kind == "op":
            if not row["op"]:
                row["op"], row["node"] = V.op.name if V.op else "", V.name
                row["input"] = fmt(st.inputs[e.dst_in])
            row["output"] = fmt(st.outputs[0]) if st.outputs else ""
        src = U
        while src.kind == "reshard":  # the parameter behind a shared use
            src = g.vars[next(x.src for x in g.edges if x.dst == g.index[src.name])]
        if src.kind == "param" and row["weight"] == "-" and src.fqn.endswith("weight"):
            row["weight"] = fmt(src.strategies[sol.choice[g.index[src.name]]].outputs[0])
        row["collectives"].extend(str(x) for x in edge_steps(g, e, sol))
        row["bytes"] += float(e.bytes[sol.choice[e.src], sol.choice[e.dst]])
    for vi, V in enumerate(g.vars):  # communication inside ops: halo exchanges, summed statistics
        c = sol.choice[vi]
        if V.op is None or V.op_comm is None or not V.op_comm[c, 0]:
            continue
        key = V.module or V.name
        row = rows.setdefault(key, {"layer": key, "op": V.op.name, "node": V.name, "weight": "-", "input": "",
                                    "output": "", "collectives": [], "bytes": 0.0})
        row["collectives"].extend(op_steps(V.op, V.strategies[c], g.mesh))
        row["bytes"] += float(V.op_comm[c, 0])
    out = [r for r in rows.values() if r["op"] or r["collectives"]]
    for r in out:
        r["bytes"] = float(f"{r['bytes']:.6g}")
    return out


def own_step(op: OpSpec, kind: str) -> str:
    """What a collective an op runs inside itself is called in the record: causal attention's rows moved to and
    from the zig-zag layout (``zigzag_rows``) or ring attention's key/value passes (``ring_kv``), routed experts'
    dispatch and combine, a windowed op's halo exchange, cross-entropy's per-row statistics gathered over its class
    split (``class_statistics``), batch norm's statistics."""
    if op.name == SDPA:
        return {"all_to_all": "zigzag_rows", "halo": "ring_kv"}.get(kind, kind)
    return {"halo": "halo", "all_to_all": "dispatch_combine", "all_gather": "class_statistics"}.get(kind,
                                                                                                 "sum_statistics")


def op_steps(op: OpSpec, st: Strategy, mesh: Mesh) -> list[str]:
    """The communication an op runs inside under ``st``: its halo steps, the axes its statistics sum over and
    those its own all-to-alls run on."""
    out = [str(halo_step(w, axis, mesh)) for axis, w in halos(windows_of(op), st)]
    entry = rules.lookup(op.target)
    if entry is not None and entry.sync_args is not None:
        sync = entry.sync_args(op, st)
        out += [f"sum_statistics[axis {a}]" for a in sync.get("axes", ())]
        a2a: Sequence[int] = sync.get("a2a") or (sync.get("row_axes", ()) if sync.get("zigzag") else ())
        out += [f"{own_step(op, 'all_to_all')}[axis {a}]" for a in a2a]
        out += [f"{own_step(op, 'halo')}[axis {a}]" for a in (sync.get("row_axes", ()) if sync.get("ring") else ())]
        out += [f"{own_step(op, 'all_gather')}[axis {a}]" for a in sync.get("class_axes", ())]
    return out


def context_parallel_records(g: PlanGraph, sol: Solution) -> list[dict[str, Any]]:
    """One row per attention op whose query sequence the plan splits, in graph order: the op, the ``method``
    (``all_gather_kv``: query rows split, keys and values whole, gathered by their edges as the Llama 3 paper's
    context parallelism does; causal ones offset their mask, ``runtime.attention``), the mesh ``axes`` and their
    ``degree``, and the rows' ``layout``: ``contiguous`` (each member its own chunk) or ``zigzag`` (computed as one
    early and one late chunk per member: ``ir.attention``).  ``method`` ``ring``: the keys and values split along
    the sequence too, passed around the members (``runtime.ring``)."""
    out = []
    for vi, V in enumerate(g.vars):
        if V.op is not None and V.op.name == SDPA:
            st = V.strategies[sol.choice[vi]]
            axes = list(row_axes(V.op, st))
            if axes:
                out.append({"op": V.name, "method": cp_method(V.op, st), "axes": axes,
                            "degree": math.prod(g.mesh.shape[a] for a in axes),
                            "layout": ZIGZAG if zigzag_layout(st) else "contiguous"})
    return out


def moe_records(g: PlanGraph, sol: Solution) -> list[dict[str, Any]]:
    """One row per routed-experts op (``ir.experts``), in graph order: its layer, experts and choices per token,
    the mesh ``axes`` splitting the experts and their ``degree`` (how many ranks hold a share; 1 when none does),
    those of them the rows move on by all-to-all (``dispatch``) and those leaving a pending sum (``partial``), the axes
    splitting every expert inside along its FFN dim (``ffn_axes``: tensor parallelism inside the experts, a pending
    sum too), and the routing imbalance it was priced at (``Profile.expert_imbalance``)."""
    out = []
    for vi, V in enumerate(g.vars):
        if V.op is None or V.op.target is not ROUTED_EXPERTS:
            continue
        st = V.strategies[sol.choice[vi]]
        axes, dispatch = map(list, expert_axes(st))
        degree = math.prod(g.mesh.shape[a] for a in axes)
        out.append({"layer": layer_of(V.module) or V.module, "node": V.name, "experts": int(V.op.args[4]),
                    "top_k": int(V.op.inputs[1].shape[1]), "axes": axes, "degree": degree,
                    "dispatch": dispatch, "partial": [a for a in axes if a not in dispatch],
                    "ffn_axes": list(ffn_axes(st)),
                    "imbalance": g.profile.expert_imbalance})
    return out
