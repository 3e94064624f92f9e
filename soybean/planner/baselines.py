"""Baselines: the layouts a practitioner would choose, as restrictions of the candidate table.

Each baseline fixes a mesh and restricts what the table may hold: the tilings every parameter and
input may be stored in (``domains``), whether a parameter must be used as it is stored (``pin``,
any other use priced at ``graph.PINNED``) and on which axes it is instead gathered whole for use
(``gather``: FSDP), and whether every op must divide its work.  The same ILP then picks the
cheapest plan the layout allows and the same cost model prices it, so a baseline is comparable
with the plan, and on a mesh the planner searched the plan is never worse than it.

* ``data_parallel`` (1-D mesh of every device): every parameter replicated and used replicated, every
  input split on dim 0, every op's work divided (DDP);
* ``model_parallel`` (1-D): inputs replicated, every parameter with 2+ dims stored split on every axis
  and used where it is stored, never gathered (the best Megatron-style plan the rules allow);
* ``fsdp`` (1-D): ZeRO-3.  Every parameter stored split on its first dim that splits over every
  device, gathered whole for use (forward and backward) and its gradient reduce-scattered back;
  inputs split on dim 0; every op's work divided;
* ``tp_fsdp`` (2-D ``(nodes, gpus_per_node)``, else ``(devices // tp, tp)``, ``tp = min(8, devices)``:
  torchtitan's default): Megatron tensor parallelism inside a node (axis 1: every parameter with 2+
  dims stored split and used as stored, the solver choosing column or row; smaller ones replicated or
  split, used as stored) and FSDP across nodes (axis 0: every parameter also split on another dim,
  gathered for use); inputs split on dim 0 across nodes, replicated inside one;
* ``megatron_tp_dp``: the same mesh, with plain data-parallel replicas across nodes (axis 0:
  parameters replicated): DP x TP;
* ``hsdp`` (2-D ``(nodes, gpus_per_node)``, more than one node): hybrid-sharded data parallelism, FSDP inside
  a node (axis 1: every parameter split, gathered for use) and replicas across nodes (axis 0), the batch split
  over both (torch's ``fully_shard`` on a 2-D mesh, torchtitan's ``data_parallel_replicate_degree``);
* ``fsdp_recompute``: ``fsdp`` with every layer recomputed in backward (full activation checkpointing,
  ``graph.recomputable_layers``), as FSDP users train under a tight budget;
* ``fsdp_selective_recompute``: ``fsdp`` with only each layer's attention module recomputed (selective
  recomputation, Korthikanti et al. 2022; ``graph.attention_units``);
* ``ep_fsdp`` (a model with routed experts only: ``ir.experts``; 2-D ``(devices // ep, ep)``): torchtitan's
  expert parallelism borrowed from data parallelism.  The experts split ``ep`` ways on axis 1 (``ep``: the largest
  divisor of the experts and the devices up to a node, 8 when the node size is not given), their rows moved by
  all-to-all, and FSDP-sharded across axis 0 (gathered there for use); every other parameter FSDP-sharded over
  both axes; the batch split over both;
* ``cp_tp_fsdp`` (a model with causal attention only; ``tp_fsdp``'s mesh): torchtitan's long-context layout,
  context parallelism across nodes with FSDP on the same axis (its ``dp_shard x cp`` sharding) and tensor
  parallelism inside a node.  Every user input of 2+ dims split along its sequence (dim 1) on axis 0, the batch
  whole; parameters as ``tp_fsdp``'s; every attention op's query rows split on axis 0 (``sequence_axes``), its keys
  and values gathered or passed around the ring as the solver chooses; the solver places the other activations.

**Made to fit as experts make them fit.**  Under a memory budget, each of ``FITTED`` that does not fit is priced
again with selective activation checkpointing, then with full (every layer), the way torchtitan's users turn on
``activation_checkpoint.mode``; its record then says which (``"recompute": "selective" | "full"``) and is
``infeasible`` only when even full checkpointing does not fit.  Every baseline computes in the plan's precision
(the same capture).  torchtitan's published Llama-3 configurations are among them: 8B trains as ``fsdp`` (one
node, selective checkpointing), 70B as ``tp_fsdp`` (TP 8 inside a node, FSDP across, full checkpointing).

A layout that cannot run is recorded as ``{"infeasible": why}``: the batch does not split over the
data-parallel devices, the devices do not fill whole nodes, the restricted table needs a forbidden
resharding, or the plan does not fit the memory budget even checkpointed.  It is never priced at the penalty.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from ..capture.core import Captured
from ..cost.memory import GIB, budget_needed
from ..cost.pricing import PricingCache
from ..cost.profiles import Profile
from ..graph import PINNED, PlanGraph, SharedWork, attention_units, build, recomputable_layers
from ..ir.experts import OP as ROUTED_EXPERTS
from ..mesh import Mesh
from ..rules.base import has_empty_tile
from ..search import SearchError
from ..tiling import R, Shard, is_valid

NAMES = ("data_parallel", "model_parallel", "fsdp", "tp_fsdp", "megatron_tp_dp", "hsdp", "fsdp_recompute",
         "fsdp_selective_recompute")
# The baselines made to fit a budget by activation checkpointing (selective, then full), as experts do.
FITTED = ("data_parallel", "fsdp", "tp_fsdp", "megatron_tp_dp", "hsdp", "ep_fsdp", "cp_tp_fsdp")
MOE_NAMES = ("ep_fsdp",)  # the baselines of a model with routed experts, beside ``NAMES``
CP_NAMES = ("cp_tp_fsdp",)  # the baselines of a model with causal attention, beside ``NAMES``
CHECKPOINTING = ("selective", "full")
TP_MAX = 8  # tensor-parallel degree when the node size is not given: one 8-GPU node


@dataclass
class Layout:
    """One baseline as a restriction of the candidate table on ``mesh`` (see ``graph.build``)."""

    name: str
    mesh: Mesh | None       # None: no mesh of this shape exists for the devices (``infeasible`` says why)
    domains: dict[str, list[tuple]] = field(default_factory=dict)
    pin: bool = True
    gather: tuple[int, ...] = ()
    gather_of: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per-parameter gather axes (experts)
    divide_work: bool | None = True
    recompute: frozenset[str] = frozenset()  # units whose forward reruns in backward (``codegen.recompute``)
    sequence_axes: tuple[int, ...] = ()  # the axes every attention op's query rows split on (context parallelism)
    cannot: str = ""        # why the layout has only forbidden reshardings, when it has
    infeasible: str = ""    # why it cannot run at all, known before building its table

    def table(self, cap: Captured, profile: Profile, objective: str, gpus_per_node: int | None,
              pricing: PricingCache | None = None, lazy_outputs: bool = False,
              work: SharedWork | None = None) -> PlanGraph:
        """The restricted candidate table, priced with the axes that cross nodes on the inter-node link
        (``pricing``: the planner run's cache; ``lazy_outputs``: the plan's output contract, ``graph.build``;
        ``work``: what builds of the same layout with other units recomputed found, ``graph.SharedWork``)."""
        assert self.mesh is not None, self.infeasible
        return build(cap, self.mesh, profile.on_mesh(self.mesh, gpus_per_node), objective=objective,
                     domains=self.domains, pin_params=self.pin, gather_axes=self.gather, gather_of=self.gather_of,
                     divide_work=self.divide_work, recompute=self.recompute, pricing=pricing,
                     context_parallel=self.sequence_axes or "auto", lazy_outputs=lazy_outputs, work=work)

    def same_table(self, other: Layout) -> bool:
        return self.same_but_recompute(other) and self.recompute == other.recompute

    def same_but_recompute(self, other: Layout) -> bool:
        """The same restriction of the same mesh, whatever either recomputes: builds that may share their work
        (``graph.SharedWork``: only what an op keeps and whether it reruns tells their tables apart)."""
        return (self.mesh, self.domains, self.pin, self.gather, self.gather_of, self.divide_work,
                self.sequence_axes) == (other.mesh, other.domains, other.pin, other.gather, other.gather_of,
                                        other.divide_work, other.sequence_axes)


class Priced(Protocol):
    """What a solved table reports (``planner.Result``)."""

    comm_bytes: float
    memory: float

    @property
    def step_time_s(self) -> float: ...


# ---- the layouts' building blocks ----

def _placeholders(cap: Captured) -> dict[str, torch.Tensor]:
    return {n.name: v for n in cap.graph.nodes
            if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor)}


def batch_split(cap: Captured, mesh: Mesh, axes: tuple[int, ...] | None = None) -> dict[str, list[tuple]]:
    """Every user input split on dim 0 over the mesh ``axes`` (default: all), replicated on the others
    (replicated everywhere when it cannot be split so)."""
    axes = tuple(range(mesh.ndim)) if axes is None else axes
    t = tuple(Shard(0) if a in axes else R for a in range(mesh.ndim))
    vals = _placeholders(cap)
    doms: dict[str, list[tuple]] = {}
    for name in cap.inputs:
        v = vals.get(name)
        ok = v is not None and v.dim() > 0 and is_valid(t, tuple(v.shape), mesh)
        doms[name] = [t] if ok else [(R,) * mesh.ndim]
    return doms


def _splits(t: tuple, shape: tuple[int, ...], mesh: Mesh) -> bool:
    """``t`` is a tiling of ``shape`` that leaves no device an empty tile (one the ops accept)."""
    return is_valid(t, shape, mesh) and not has_empty_tile(t, shape, mesh)


def _unsplit_batch(cap: Captured, mesh: Mesh, axes: tuple[int, ...]) -> str:
    """Why the batch cannot be divided over the data-parallel ``axes`` ("" when some input splits)."""
    t = tuple(Shard(0) if a in axes else R for a in range(mesh.ndim))
    vals = _placeholders(cap)
    batched = [(n, vals[n]) for n in cap.inputs if n in vals and vals[n].dim() > 0]
    if not batched or any(_splits(t, tuple(v.shape), mesh) for _, v in batched):
        return ""
    n, v = batched[0]
    p = 1
    for a in axes:
        p *= mesh.shape[a]
    return f"a batch of {v.shape[0]} (input {n}, dim 0) does not split over {p} data-parallel devices " \
           "without an empty tile"


def all_shard_tilings(shape: tuple[int, ...], mesh: Mesh) -> list[tuple]:
    """Every valid tiling that splits ``shape`` on every mesh axis."""
    return [tuple(t) for t in itertools.product([Shard(d) for d in range(len(shape))], repeat=mesh.ndim)
            if is_valid(t, shape, mesh)]


def model_parallel_domains(cap: Captured, mesh: Mesh) -> dict[str, list[tuple]]:
    """Inputs replicated; every parameter with 2+ dims stored split on every axis (any valid dims)."""
    doms: dict[str, list[tuple]] = {name: [(R,) * mesh.ndim] for name in cap.inputs}
    vals = _placeholders(cap)
    for name, fqn in cap.params.items():
        v = vals.get(name)
        if v is not None and v.dim() >= 2 and (opts := all_shard_tilings(tuple(v.shape), mesh)):
            doms[fqn] = opts
    return doms


def _param_tilings(shape: tuple[int, ...], mesh: Mesh, shard: tuple[int, ...], tp: int | None) -> list[tuple]:
    """A parameter's stored tilings with FSDP on the ``shard`` axes and Megatron tensor parallelism on axis ``tp``
    (every other axis replicated).

    TP axis: a weight of 2+ dims is split on some dim (the solver picks which: column or row); a smaller tensor
    may be split or replicated.  Each FSDP axis: split on the first dim that the TP axis and the FSDP axes before
    it leave unsplit and that splits without an empty tile (else replicated)."""
    n = mesh.ndim
    tp_opts: list[Any] = [R]
    if tp is not None:
        shards = [Shard(d) for d in range(len(shape)) if _splits((Shard(d),), shape, Mesh((mesh.shape[tp],)))]
        tp_opts = shards if len(shape) >= 2 and shards else [R] + shards
    out = []
    for q in tp_opts:
        t: list[Any] = [R] * n
        if tp is not None:
            t[tp] = q
        for axis in shard:
            for d in range(len(shape)):
                if Shard(d) not in t and _splits(tuple(Shard(d) if a == axis else t[a] for a in range(n)), shape, mesh):
                    t[axis] = Shard(d)
                    break
        if _splits(tuple(t), shape, mesh):
            out.append(tuple(t))
    return out or [(R,) * n]


def _hybrid(name: str, cap: Captured, mesh: Mesh, replicate: tuple[int, ...] = (), shard: tuple[int, ...] = (),
            tp: int | None = None) -> Layout:
    """Data parallelism on the mesh axes ``replicate`` (replicas) and ``shard`` (FSDP), Megatron tensor
    parallelism on axis ``tp``; the batch split over every data-parallel axis."""
    vals = _placeholders(cap)
    doms = {fqn: _param_tilings(tuple(vals[n].shape), mesh, shard, tp) for n, fqn in cap.params.items() if n in vals}
    dp_axes = tuple(sorted(replicate + shard))
    doms.update(batch_split(cap, mesh, dp_axes))
    if tp is None:  # pure data parallelism: every op divides its work by the batch
        why = ("FSDP gathers every weight whole for use" if shard else
               "data parallelism keeps every weight whole") + \
              " and divides every op's work by the batch, and some op cannot divide it so"
        divide: bool | None = True
    else:  # the solver places the activations as the objective's own table does
        why = "tensor parallelism uses every weight in the split it is stored in, and some op cannot use one so"
        divide = None
    lay = Layout(name, mesh, doms, pin=True, gather=shard, divide_work=divide, cannot=why)
    lay.infeasible = _unsplit_batch(cap, mesh, dp_axes) if dp_axes else ""
    return lay


def tp_mesh(devices: int, gpus_per_node: int | None) -> tuple[Mesh | None, int | None, int | None, str]:
    """The 2-D mesh of the TP baselines, ``(nodes, tp)``, with its data-parallel and tensor-parallel
    axes (an axis of one device is left out), or why there is none."""
    tp = min(gpus_per_node or TP_MAX, devices)
    if devices % tp:
        return None, None, None, f"{devices} devices do not fill whole nodes of {tp}"
    dp = devices // tp
    if dp == 1:
        return Mesh((tp,)), None, 0, ""
    if tp == 1:
        return Mesh((dp,)), 0, None, ""
    return Mesh((dp, tp)), 0, 1, ""


def expert_weights(cap: Captured) -> dict[str, int]:
    """The parameters routed experts read as expert weights (by FQN), each with its layer's number of experts."""
    out: dict[str, int] = {}
    for n in cap.graph.nodes:
        if n.target is ROUTED_EXPERTS:
            for w in n.args[3]:
                if isinstance(w, torch.fx.Node) and w.name in cap.params:
                    out[cap.params[w.name]] = int(n.args[4])
    return out


def _ep_fsdp(cap: Captured, devices: int, gpus_per_node: int | None) -> Layout:
    """``ep_fsdp`` (module docstring)."""
    experts = expert_weights(cap)
    if not experts:
        return Layout("ep_fsdp", None, infeasible="the model has no routed experts")
    e = math.gcd(*experts.values())
    ep = max(d for d in range(1, min(gpus_per_node or TP_MAX, devices) + 1) if e % d == 0 and devices % d == 0)
    if ep == 1:
        return Layout("ep_fsdp", None, infeasible=f"{e} experts and {devices} devices have no common divisor above 1 "
                                                  f"within a node")
    mesh = Mesh((devices // ep, ep)) if devices > ep else Mesh((ep,))
    ax = mesh.ndim - 1  # the expert-parallel axis
    dp = tuple(range(ax))
    vals = _placeholders(cap)
    doms: dict[str, list[tuple]] = {}
    gather_of: dict[str, tuple[int, ...]] = {}
    for name, fqn in cap.params.items():
        if name not in vals:
            continue
        shape = tuple(vals[name].shape)
        if fqn in experts:
            t: list[Any] = [R] * mesh.ndim
            t[ax] = Shard(0)
            for axis in dp:  # FSDP of the expert weights across the other axis, on a dim the experts leave
                t[axis] = next((Shard(d) for d in range(1, len(shape)) if _splits(
                    tuple(Shard(d) if a == axis else t[a] for a in range(mesh.ndim)), shape, mesh)), R)
            doms[fqn] = [tuple(t)] if _splits(tuple(t), shape, mesh) else [(R,) * mesh.ndim]
            gather_of[fqn] = dp
        else:
            doms[fqn] = _param_tilings(shape, mesh, tuple(range(mesh.ndim)), None)
    doms.update(batch_split(cap, mesh))
    lay = Layout("ep_fsdp", mesh, doms, pin=True, gather=tuple(range(mesh.ndim)), gather_of=gather_of,
                 divide_work=None, cannot="expert parallelism uses each expert weight in the split it is stored in, "
                                          "and some op cannot use one so")
    lay.infeasible = _unsplit_batch(cap, mesh, tuple(range(mesh.ndim)))
    return lay


def causal_attention(cap: Captured) -> bool:
    """Does the model run a causal attention op (``is_causal``), the one context parallelism splits?"""
    return any(n.target is torch.ops.aten.scaled_dot_product_attention.default
               and (n.kwargs.get("is_causal") or (len(n.args) > 5 and n.args[5] is True)) for n in cap.graph.nodes)


def _cp_tp_fsdp(cap: Captured, devices: int, gpus_per_node: int | None) -> Layout:
    """``cp_tp_fsdp`` (module docstring)."""
    mesh, cp, tp, why = tp_mesh(devices, gpus_per_node)
    if mesh is None or cp is None:
        return Layout("cp_tp_fsdp", None, infeasible=why or "one node: no axis across nodes to split the sequence on")
    vals = _placeholders(cap)
    doms = {fqn: _param_tilings(tuple(vals[n].shape), mesh, (cp,), tp) for n, fqn in cap.params.items() if n in vals}
    seq = tuple(Shard(1) if a == cp else R for a in range(mesh.ndim))
    for name in cap.inputs:
        v = vals.get(name)
        doms[name] = [seq] if v is not None and v.dim() >= 2 and _splits(seq, tuple(v.shape), mesh) else \
            [(R,) * mesh.ndim]
    lay = Layout("cp_tp_fsdp", mesh, doms, pin=True, gather=(cp,), divide_work=None, sequence_axes=(cp,),
                 cannot="tensor parallelism uses every weight in the split it is stored in, and some op cannot use "
                        "one so")
    if all(d == [(R,) * mesh.ndim] for n, d in doms.items() if n in cap.inputs):
        lay.infeasible = f"no input has a sequence (dim 1) that splits over {mesh.shape[cp]} nodes"
    return lay


def layouts(cap: Captured, devices: int, gpus_per_node: int | None = None) -> dict[str, Layout]:
    """Every baseline's layout on ``devices`` (see the module docstring)."""
    flat = Mesh((devices,))
    out = {
        "data_parallel": _hybrid("data_parallel", cap, flat, replicate=(0,)),
        "model_parallel": Layout("model_parallel", flat, model_parallel_domains(cap, flat), cannot=(
            "model parallelism uses every weight in the split it is stored in, and some op cannot use one so")),
        "fsdp": _hybrid("fsdp", cap, flat, shard=(0,)),
    }
    mesh, dp, tp, why = tp_mesh(devices, gpus_per_node)
    for name, fsdp in (("tp_fsdp", True), ("megatron_tp_dp", False)):
        dp_axes = () if dp is None else (dp,)
        out[name] = _hybrid(name, cap, mesh, replicate=() if fsdp else dp_axes, shard=dp_axes if fsdp else (), tp=tp) \
            if mesh is not None else Layout(name, None, infeasible=why)
    g = gpus_per_node
    if g is None or devices <= g:
        out["hsdp"] = Layout("hsdp", None, infeasible="one node: HSDP replicates across nodes (--gpus-per-node), "
                                                       "inside one it is fsdp")
    elif devices % g:
        out["hsdp"] = Layout("hsdp", None, infeasible=f"{devices} devices do not fill whole nodes of {g}")
    else:
        out["hsdp"] = _hybrid("hsdp", cap, Mesh((devices // g, g)), replicate=(0,), shard=(1,))
    for name, units, none in (
            ("fsdp_recompute", recomputable_layers(cap), "the model has no layer to recompute (a block of a repeated "
                                                          "stack without in-place updates)"),
            ("fsdp_selective_recompute", attention_units(cap), "no layer has an attention module of its own")):
        out[name] = replace(out["fsdp"], name=name, recompute=frozenset(units))
        out[name].infeasible = out[name].infeasible or ("" if units else none)
    if expert_weights(cap):
        out["ep_fsdp"] = _ep_fsdp(cap, devices, gpus_per_node)
    if causal_attention(cap):
        out["cp_tp_fsdp"] = _cp_tp_fsdp(cap, devices, gpus_per_node)
    return out


def checkpointed(lay: Layout, cap: Captured, mode: str) -> Layout | None:
    """``lay`` with ``mode`` activation checkpointing (``selective``: each layer's attention recomputed; ``full``:
    every layer), or None when the model has no such unit."""
    units = frozenset(attention_units(cap) if mode == "selective" else recomputable_layers(cap))
    return replace(lay, recompute=units) if units else None


# ---- pricing ----

def infeasible(why: str) -> dict[str, Any]:
    """The record of a baseline that cannot run: why (the reason names the devices it needed)."""
    return {"infeasible": why}


def over_budget(r: Priced, budget: float | None) -> bool:
    """A plan that runs (no forbidden resharding) but misses the memory budget."""
    return r.comm_bytes < PINNED and r.step_time_s < PINNED and budget is not None and r.memory > budget


def record(lay: Layout, r: Priced, budget: float | None) -> dict[str, Any]:
    """A baseline's bytes and step time on its mesh, or why it cannot run: a layout that needs a
    forbidden resharding (the pinned penalty, ``graph.PINNED``, in its cost), or one that does not fit
    the budget.  Never the penalty printed as bytes."""
    if r.comm_bytes >= PINNED or r.step_time_s >= PINNED:
        return infeasible(lay.cannot)
    if over_budget(r, budget):
        return infeasible(f"needs {budget_needed(r.memory) / GIB:.4g} GiB per device (--memory-gb), over the budget")
    mesh = list(lay.mesh.shape) if lay.mesh is not None else []
    return {"comm_bytes": float(r.comm_bytes), "step_time_s": float(r.step_time_s), "mesh": mesh}


def price(
    cap: Captured,
    devices: int,
    profile: Profile,
    objective: str,
    solve: Callable[[PlanGraph], Priced],
    budget: float | None = None,
    gpus_per_node: int | None = None,
    pricing: PricingCache | None = None,
    lazy_outputs: bool = False,
) -> dict[str, dict[str, Any]]:
    """Every baseline on ``devices``, each solved by ``solve`` on its restricted table, those of ``FITTED`` that miss
    ``budget`` again with selective then full checkpointing (module docstring).  A layout whose table equals one
    already solved (both TP baselines on one node; ``fsdp`` checkpointed and ``fsdp_recompute``) reuses that record.
    ``pricing``: the planner run's cache (one fresh cache for all of them when none is given); ``lazy_outputs``: the
    plan's output contract (``PlanOptions.outputs``), so each baseline pays for its outputs what the plan pays."""
    pricing = pricing or PricingCache()
    out: dict[str, dict[str, Any]] = {}
    done: list[tuple[Layout, dict[str, Any], bool]] = []
    # ``fsdp``, its two checkpointed forms and each fitted layout's: one layout's builds share what recomputation
    # never changes, as a mesh's recomputation choices do (``planner.solve_recompute``)
    works: list[tuple[Layout, SharedWork]] = []

    def work_of(lay: Layout) -> SharedWork:
        work = next((w for other, w in works if other.same_but_recompute(lay)), None)
        if work is None:
            work = SharedWork()
            works.append((lay, work))
        return work

    def priced(lay: Layout) -> tuple[dict[str, Any], bool]:
        """The layout's record, and whether it runs but misses the budget."""
        same = next(((rec, over) for other, rec, over in done if other.same_table(lay)), None)
        if same is None:
            try:
                r = solve(lay.table(cap, profile, objective, gpus_per_node, pricing, lazy_outputs, work_of(lay)))
                same = record(lay, r, budget), over_budget(r, budget)
            except SearchError as e:
                same = infeasible(str(e)), False
            done.append((lay, *same))
        return dict(same[0]), same[1]

    for name, lay in layouts(cap, devices, gpus_per_node).items():
        if lay.infeasible:
            out[name] = infeasible(lay.infeasible)
            continue
        rec, over = priced(lay)
        for mode in CHECKPOINTING if name in FITTED and over else ():
            fitted = checkpointed(lay, cap, mode)
            if fitted is None:
                continue
            tried, over = priced(fitted)
            if not over:
                rec = tried if "infeasible" in tried else {**tried, "recompute": mode}
                break
            rec = {"infeasible": f"{tried['infeasible']}, even with {mode} activation checkpointing"}
        out[name] = rec
    return out
