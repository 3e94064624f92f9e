"""torchtitan's 3-D layouts as baselines: pipeline stages across nodes, each stage tensor-parallel inside a node and
FSDP across its nodes (``baselines.tp_fsdp`` on the stage's devices), trained 1F1B or interleaved 1F1B.

As torchtitan configures it: ``S`` pipeline stages of whole layers, cut evenly (``stages.even_bounds``; ``S v`` of
them with ``v = 2`` virtual stages per rank group under the interleaved schedule), each on ``world / S`` devices
holding ``F = world / (S tp)`` FSDP replicas of TP ``tp`` (``tp`` = a node, ``baselines.tp_mesh``); ``M``
microbatches, at least ``S``: one sequence per FSDP replica each (torchtitan's default
``pipeline_parallel_microbatch_size`` of 1, ``M = batch / F``), or any count from ``S`` to ``4 S`` that divides the
replica's batch, as an expert tunes it (``microbatch_counts``). Each stage is the ``tp_fsdp`` baseline of the
capture at the microbatch (``batch / M`` sequences) on its devices, solved as every baseline is
(``planner.solve_table``, layers tied), and made to fit as experts make it fit: with no activation checkpointing,
then selective, then full, the first whose memory fits the budget with its microbatches in flight
(``pipeline_plan.inflight``: 1F1B's stage ``s`` holds ``S - s``). The step is priced as soybean's own pipelined
plans are (``pipeline_plan.pipeline_step``): ``M`` times the slowest rank group's time per microbatch (its stages'
plans plus their sends) over ``1 - bubble``, plus the gradient synchronisation, once per step.

Every pipeline degree ``S`` that fits whole TP groups, whose FSDP degree divides the batch, and whose layers fill
the stages is priced; each baseline's record is its fastest (``stages``, ``microbatches``, ``mesh`` ``[S, F, tp]``,
each stage's ``microbatch_s`` and ``sync_s``, the most memory a device needs, and ``recompute`` when checkpointed:
the most any stage needed), or ``{"infeasible": why}`` when none runs.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..capture.core import Captured
from ..cost.memory import GIB, budget_bytes, budget_needed
from ..cost.pricing import PricingCache
from ..cost.profiles import Profile, load_profile
from ..options import PlanOptions
from ..planner.baselines import CHECKPOINTING, checkpointed, infeasible, layouts, tp_mesh
from ..planner.records import memory_breakdown
from ..search import SearchError
from .part import value_facts
from .pipeline_plan import bubble_fraction, inflight, layer_signatures, pipeline_step, sends_s
from .stages import even_bounds, layers, split

# name: (virtual stages per rank group, schedule)
SCHEDULED = {"pp_tp_fsdp": (1, "1f1b"), "pp_tp_fsdp_interleaved": (2, "interleaved-1f1b")}


def degrees(world: int, batch: int, gpus_per_node: int | None) -> list[tuple[int, int, int]]:
    """The ``(S, F, tp)`` torchtitan would run: ``S >= 2`` stages of whole TP groups, ``F`` FSDP replicas per stage
    dividing the batch into at least ``S`` microbatches."""
    out = []
    for s in range(2, world + 1):
        if world % s:
            continue
        mesh, _, tp_axis, _ = tp_mesh(world // s, gpus_per_node)
        if mesh is None:
            continue
        tp = mesh.shape[tp_axis] if tp_axis is not None else 1
        f = world // s // tp
        if batch % f == 0 and batch // f >= s:
            out.append((s, f, tp))
    return out


def microbatch_counts(stages: int, local: int) -> list[int]:
    """The microbatch counts an expert tries with ``local`` sequences per FSDP replica: torchtitan's default (a
    microbatch of one sequence per replica: ``local``), and every count from ``stages`` to ``4 stages`` that
    divides ``local`` (a microbatch of ``local / count`` sequences per replica, ``count`` microbatches)."""
    return sorted({local} | {c for c in range(stages, 4 * stages + 1) if local % c == 0})


def price(capture_at: Callable[[int], Captured], batch: int, world: int, options: PlanOptions,
          say: Callable[[str], None] = lambda line: None) -> dict[str, dict[str, Any]]:
    """Each of ``SCHEDULED``'s records (module docstring); ``capture_at(M)``: the model captured at ``M``
    microbatches."""
    from ..planner.solve import solve_table

    profile = options.profile if isinstance(options.profile, Profile) else load_profile(options.profile)
    budget = budget_bytes(options.memory_gb)
    pricing = PricingCache()
    out: dict[str, dict[str, Any]] = {}
    caps: dict[int, Captured] = {}
    facts_at: dict[int, dict[str, tuple[int, bool]]] = {}  # each capture's value facts, found once
    solved: dict[tuple, tuple[float, float, float, float, float]] = {}  # (microbatches, stage key, mode) -> priced

    def stage_priced(m: int, key: tuple, st_cap: Captured, per: int,
                     mode: str) -> tuple[float, float, float, float, float]:
        """``(seconds per microbatch less sends and gradient sync, bytes, peak, activations, gradient sync)`` of one
        stage's tp_fsdp plan (``pipeline_plan.microbatch_s``), infinite when its table cannot run."""
        if (m, key, mode) not in solved:
            lay = layouts(st_cap, per, options.gpus_per_node)["tp_fsdp"]
            if mode != "none":
                lay = checkpointed(lay, st_cap, mode) or lay
            try:
                g = lay.table(st_cap, profile, options.objective, options.gpus_per_node, pricing)
                r = solve_table(g, options.objective, "ilp", options.time_limit_s, options.tie_layers)
                acts = memory_breakdown(g, r.solution)["activations"]
                solved[(m, key, mode)] = (r.step_time_s - r.sync_s + r.hidden_s, r.comm_bytes, r.memory, acts,
                                          r.sync_s)
            except SearchError:
                solved[(m, key, mode)] = (math.inf, math.inf, math.inf, 0.0, 0.0)
        return solved[(m, key, mode)]

    for name, (v, schedule) in SCHEDULED.items():
        best: dict[str, Any] | None = None
        why = "no pipeline degree fits: stages of whole TP groups whose FSDP degree divides the batch"
        runs = [(d, r, t, c) for d, r, t in degrees(world, batch, options.gpus_per_node)
                for c in microbatch_counts(d, batch // r)]
        for s, f, tp, m in runs:
            if m not in caps:
                caps[m] = capture_at(m)
                facts_at[m] = value_facts(caps[m])
            cap, facts = caps[m], facts_at[m]
            names, sigs = layers(cap), layer_signatures(cap)
            if s * v > len(names):
                continue
            bounds = even_bounds(len(names), s * v)
            cut = split(cap, bounds)
            per = world // s
            times: list[float] = []
            syncs: list[float] = []
            sent: list[float] = []
            modes: list[str] = []
            most = 0.0
            for k, (st, (a, b)) in enumerate(zip(cut, bounds)):
                key = (a == 0, b == len(names) - 1, tuple(sigs[a:b + 1]), per)
                held = inflight(schedule, k, s, m)
                for mode in ("none", *CHECKPOINTING):
                    t, nbytes, peak, acts, sync = stage_priced(m, key, st.cap, per, mode)
                    need = peak + (held - 1) * acts
                    if budget is None or need <= budget:
                        break
                else:
                    why = f"a stage needs {budget_needed(need) / GIB:.4g} GiB per device even with full checkpointing"
                    times = []
                    break
                times.append(t + sends_s(facts, st, per, profile))
                syncs.append(sync)
                sent.append(nbytes * m)
                most = max(most, need)
                modes.append(mode)
            if not times or not all(math.isfinite(t) for t in times):
                continue
            comm = max(sum(sent[i] for i in range(g, s * v, s)) for g in range(s))  # per device, its group's stages
            step = pipeline_step(times, syncs, s, m, bubble_fraction(schedule, s, m, v))
            say(f"baseline {name}: {s} stages x {f} FSDP x TP {tp}, {m} microbatches: {step:.4g} s")
            if best is None or step < best["step_time_s"]:
                worst = max(modes, key=("none", *CHECKPOINTING).index)
                best = {"comm_bytes": comm, "step_time_s": step, "mesh": [s, f, tp], "stages": s * v,
                        "microbatches": m, "schedule": schedule, "microbatch_s": times, "sync_s": syncs,
                        "memory_bytes": most,
                        **({"recompute": worst} if worst != "none" else {})}
        out[name] = best if best is not None else infeasible(why)
    return out
