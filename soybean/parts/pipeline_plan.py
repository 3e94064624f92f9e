"""A pipelined plan: stages cut from the capture (``soybean.parts.stages``), each planned on its own submesh by the
planner, and the schedule priced on top.

Priced per microbatch: each stage's step on its submesh (its own plan's modelled ``step_time_s``: forward,
backward and communication of one microbatch, the capture being the microbatch's) plus the transfers it sends
(every boundary value forward and its gradient back: ``part.crossing_s``, on the ``"schedule"`` link).  A rank group
runs its stages one after the other (``virtual_stages`` of them under the interleaved schedules), and the schedule
idles a fraction ``bubble`` of the step (``bubble_fraction``), so the step is ``m`` times the slowest group's time
over ``1 - bubble``: ``(m + p - 1)`` slots of the slowest stage for GPipe and 1F1B.

``plan_pipeline`` prices a given number of stages (cut evenly in layers, ``stages.even_bounds``, or as given);
``search_pipeline`` searches stage counts, microbatch counts and cuts (``best_cut`` over ``StageCosts``), each
stage's submesh chosen by its own planner run.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..capture.core import Captured
from ..cost.memory import GIB, budget_bytes
from ..cost.profiles import Profile, load_profile
from ..graph.units import node_layer
from ..options import PlanOptions
from ..plan import Plan
from .part import Facts, boundary_bytes, crossing_s, grad_bytes, shared_params, tie_s, value_facts
from .stages import Stage, even_bounds, layers, pieces, split


def plan_pipeline(cap: Captured, world: int, stages: int, microbatches: int, schedule: str,
                  options: PlanOptions, virtual_stages: int | None = None,
                  bounds: Sequence[tuple[int, int]] | None = None,
                  facts: Facts | None = None) -> tuple[list[Stage], list[Plan], Plan]:
    """The stages of ``cap`` (captured at the microbatch), each one's plan on ``world // stages`` devices, and the
    pipelined plan (``Plan.pipeline`` holding the stages' plans).  ``stages`` is the pipeline's depth (rank
    groups); with ``virtual_stages`` ``v`` (None: ``PlanOptions.virtual``'s default for ``schedule``) the layers are
    cut into ``stages * v`` stages, stage ``i`` on group ``i % stages`` (the interleaved schedule).  ``bounds``:
    the cut (``search_pipeline``'s); default even in layers.  ``options``: each stage's planner's
    (``PlanOptions.one_program``).  ``facts``: ``part.value_facts(cap)``, when the caller has them."""
    # the schedule and its virtual stages checked (and defaulted) where every front end checks them, before planning
    virtual_stages = PlanOptions(schedule=schedule, virtual_stages=virtual_stages).virtual
    if stages < 2 or world % stages:
        raise ValueError(f"{stages} pipeline stages on {world} devices: use a number of at least 2 that divides "
                         f"the devices ({[s for s in range(2, world + 1) if world % s == 0]})")
    names = layers(cap)
    total = stages * virtual_stages
    bounds = list(bounds) if bounds is not None else even_bounds(len(names), total)
    cut = split(cap, bounds)
    per = world // stages
    plans = [stage_plan(st.cap, per, options, inflight(schedule, k, stages, microbatches))
             for k, st in enumerate(cut)]
    profile = options.profile if isinstance(options.profile, Profile) else load_profile(options.profile)
    facts = facts if facts is not None else value_facts(cap)
    per_mb = [microbatch_s(p) + sends_s(facts, st, per, profile) for p, st in zip(plans, cut)]
    bubble = bubble_fraction(schedule, stages, microbatches, virtual_stages)
    ties = tied_weights(cap, bounds, stages)
    step = pipeline_step(per_mb, [sync_s(p) for p in plans], stages, microbatches, bubble) + sum(
        tie_s(t["bytes"], len(t["stages"]), profile) for t in ties)
    record: dict[str, Any] = {
        "schedule": schedule, "microbatches": microbatches, "virtual_stages": virtual_stages, "bubble": bubble,
        "tied": ties,
        "stages": [{"units": [names[a], names[b]], "layers": [a, b],
                    "ranks": list(range((k % stages) * per, (k % stages + 1) * per)), "mesh": list(p.mesh),
                    "microbatch_s": t, "memory_bytes": stage_memory(p, inflight(schedule, k, stages, microbatches)),
                    "sends": st.returns, "send_bytes": boundary_bytes(facts, st.returns)[0],
                    "grad_bytes": boundary_bytes(facts, st.returns)[1], "plan": p.to_dict()}
                   for k, (st, p, t, (a, b)) in enumerate(zip(cut, plans, per_mb, bounds))],
    }
    budget = budget_bytes(options.memory_gb)
    over = [(k, st["memory_bytes"]) for k, st in enumerate(record["stages"])
            if budget is not None and st["memory_bytes"] > budget]
    if over:
        warnings.warn(f"soybean: pipeline stages {[k for k, _ in over]} need up to {max(b for _, b in over) / GIB:.3g} "
                      f"GiB per device with their microbatches in flight, over --memory-gb {options.memory_gb}: use "
                      "more microbatches or stages, or --pipeline auto", stacklevel=2)
    moe, cp = Plan.part_rows(plans, "stage")
    top = Plan(devices=world, mesh=[stages, per], objective=options.objective, profile=plans[0].profile,
               fingerprint=cap.fingerprint, params={}, inputs={}, nodes={},
               cost={"step_time_s": step, "compute_s": sum(p.cost.get("compute_s", 0.0) for p in plans) * microbatches},
               precision=cap.precision, pipeline=record, moe=moe, context_parallel=cp)
    return cut, plans, top


def tied_weights(cap: Captured, bounds: Sequence[tuple[int, int]], groups: int) -> list[dict[str, Any]]:
    """The trained weights that stages on two or more rank groups read (tied embeddings: ``part.shared_params``):
    each one's stages and the bytes of its gradient (``part.grad_bytes``), which the pipeline sums across those
    groups once per step (``checkpoint_view.PartsModule._sum_tied_grads``; priced by ``part.tie_s`` over its
    stages)."""
    nbytes = grad_bytes(cap)
    return [{"param": fqn, "stages": ss, "bytes": nbytes[fqn]}
            for fqn, ss in shared_params(cap, pieces(cap, bounds)).items() if len({k % groups for k in ss}) > 1]


def sends_s(facts: Facts, st: Stage, per: int, profile: Profile) -> float:
    """Seconds stage ``st`` spends per microbatch sending its boundary values to the next rank group and receiving
    their gradients back (``part.crossing_s``: each of its ``per`` ranks to the rank of its index in the next group,
    as torch's schedule sends them; none for the last stage)."""
    return crossing_s(facts, st.returns, range(per), range(per, 2 * per), profile, "schedule")


def microbatch_s(p: Plan) -> float:
    """A stage plan's modelled seconds per microbatch, its gradient synchronisation left out: its step (forward,
    backward and communication of one microbatch) less the sync, of which the step counts only what backward does
    not hide (``sync_s - hidden_s``)."""
    return p.cost["step_time_s"] - sync_s(p) + p.cost.get("hidden_s", 0.0)


def sync_s(p: Plan) -> float:
    """A stage plan's gradient synchronisation, which a pipeline runs once per step (``GradSync.defer``)."""
    return p.cost.get("sync_s", 0.0)


def pipeline_step(per_mb: Sequence[float], syncs: Sequence[float], groups: int, microbatches: int,
                  bubble: float) -> float:
    """The step of a pipeline: each rank group runs its stages (``i % groups``) one after the other per microbatch,
    ``microbatches`` times, the schedule idling ``bubble`` of it; then its stages' gradient synchronisation, once,
    after the last microbatch's backward (its own stages' backward is over, so nothing hides it), the slowest
    group's counted."""
    group_s = [sum(per_mb[i] for i in range(g, len(per_mb), groups)) for g in range(groups)]
    group_sync = [sum(syncs[i] for i in range(g, len(syncs), groups)) for g in range(groups)]
    return max(group_s) * microbatches / (1 - bubble) + max(group_sync)


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The fraction of the step the schedule idles: ``(p - 1) / (v m + p - 1)`` for GPipe and 1F1B (``v = 1``) and
    interleaved 1F1B.  Zero bubble (Qi et al., ICLR 2024) splits each backward into its input half ``B`` and weight
    half ``W`` and fills the warm-up and cool-down with ``W``: with ``F = B = W`` (a third of a slot each), ZB-H1
    leaves ``(p - 1)`` thirds of a slot idle where 1F1B leaves ``p - 1`` whole slots, so ``(p - 1) / (3 v m + p -
    1)`` (torch's ``ScheduleInterleavedZeroBubble`` is ZB-H1 over ``v`` stages per rank)."""
    thirds = 3 if schedule == "zero-bubble" else 1
    return (stages - 1) / (thirds * virtual_stages * microbatches + stages - 1)


def best_cut(n: int, parts: int, cost: Callable[[int, int], float],
             lengths: tuple[int, int] | None = None) -> tuple[list[tuple[int, int]], float]:
    """The cut of layers ``0 .. n-1`` into ``parts`` contiguous non-empty ranges whose largest ``cost(a, b)`` is
    least, and that cost: ``f(k, j) = min_i max(f(k - 1, i - 1), cost(i, j))`` over the layer chain (Alpa's
    inter-operator pass for one submesh size), exact over every cut whose stages hold ``lengths`` ``(lo, hi)``
    layers (default: any number); ``cost`` may be asked for one range more than once (``StageCosts`` memoises).
    Infinite when no such cut exists."""
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} stages of {n} layers")
    lo, hi = lengths or (1, n)
    inf = math.inf

    def priced(i: int, j: int) -> float:
        return cost(i, j) if lo <= j - i + 1 <= hi else inf

    f = [[inf] * n for _ in range(parts)]
    arg = [[-1] * n for _ in range(parts)]
    for j in range(n - parts + 1):
        f[0][j] = priced(0, j)
    for k in range(1, parts):
        for j in range(k, n - parts + k + 1):
            for i in range(max(k, j + 1 - hi), min(j, j + 1 - lo) + 1):
                if f[k - 1][i - 1] >= f[k][j]:
                    continue  # this split's first k stages already cost at least the best found
                c = max(f[k - 1][i - 1], priced(i, j))
                if c < f[k][j]:
                    f[k][j], arg[k][j] = c, i
    if not math.isfinite(f[parts - 1][n - 1]):
        return even_bounds(n, parts), inf
    bounds, j = [], n - 1
    for k in range(parts - 1, 0, -1):
        i = arg[k][j]
        bounds.append((i, j))
        j = i - 1
    bounds.append((0, j))
    return bounds[::-1], f[parts - 1][n - 1]


def stage_lengths(n: int, stages: int) -> tuple[int, int]:
    """The stage lengths the search considers for ``n`` layers in ``stages`` stages: within ``w = max(2, q / 4)``
    layers of the even length ``q = n / stages``, room for a stage holding the embedding or the head to be lighter
    by a few layers.  A restriction (the cut is exact over these): it keeps a large model's search to a few ranges
    of layers per stage kind, where every length would plan every range."""
    q = n / stages
    w = max(2, math.ceil(q / 4))
    return max(1, math.floor(q) - w), math.ceil(q) + w


def layer_signatures(cap: Captured) -> list[str]:
    """Each layer's ops and shapes in order (two layers with one signature cost the same as stages)."""
    sigs: dict[str, list[str]] = {}
    for node in cap.graph.nodes:
        if node.op == "call_function" and (layer := node_layer(node)):
            v = node.meta.get("val")
            sigs.setdefault(layer, []).append(f"{node.target}{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}")
    return [hashlib.sha1("\n".join(sigs[k]).encode()).hexdigest() for k in layers(cap)]


def stage_plan(cap: Captured, per: int, options: PlanOptions, held: int, fallback: bool = True) -> Plan:
    """A stage's plan on ``per`` devices holding the activations of ``held`` microbatches at once
    (``PlanOptions.inflight``: the budget and the recomputation search see them all).  Where no plan fits with
    them (``MemoryBudgetError``), with ``fallback`` its plan with one microbatch's: a forced pipeline still runs,
    and ``plan_pipeline`` warns that it breaks the budget.  A stage hands its outputs on whole (``run.pipelined``):
    priced as such, never left split for a lazy read."""
    from ..planner.core import plan
    from ..planner.solve import MemoryBudgetError

    def planned(n: int) -> Plan:
        return plan(None, (), per, options=options.merged(outputs="full", inflight=n), baselines=False, captured=cap)

    try:
        return planned(held)
    except MemoryBudgetError:
        if held == 1 or not fallback:
            raise
        return planned(1)


def stage_memory(p: Plan, held: int) -> float:
    """A stage's peak bytes per device holding the activations of ``held`` microbatches at once: its plan's peak
    where it was planned with them (``stage_plan``), else that peak with the other ``held - inflight`` microbatches'
    activations added."""
    per_mb = p.memory.get("activations", 0.0) / p.inflight
    return p.memory.get("peak", 0.0) + (held - p.inflight) * per_mb


def inflight(schedule: str, stage: int, groups: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at once: GPipe all of them, 1F1B ``groups - stage``
    (at most the microbatches); the interleaved schedule as 1F1B per rank group."""
    return microbatches if schedule == "gpipe" else min(microbatches, groups - stage % groups)


class StageCosts:
    """Each stage's time per microbatch on its devices, at one microbatch size (``cap``): a range of layers is
    planned once per signature (its ops and shapes, whether it holds what comes before the first layer or after
    the last), submesh size and microbatches in flight, planned with those in flight (``stage_plan``); infinite
    where no plan fits the budget with them."""

    def __init__(self, cap: Captured, options: PlanOptions, profile: Profile, microbatches: int) -> None:
        self.cap, self.options, self.profile, self.m = cap, options, profile, microbatches
        self.names, self.sigs = layers(cap), layer_signatures(cap)
        self.facts = value_facts(cap)  # once per microbatch size: every stage's sends read them
        # seconds per microbatch (sends included), memory, gradient sync, sends
        self.memo: dict[tuple, tuple[float, float, float, float]] = {}
        self.plans = 0  # stage plans made

    def _key(self, a: int, b: int, stages: int, held: int, budgeted: bool = True) -> tuple:
        n = len(self.names)
        return a == 0, b == n - 1, tuple(self.sigs[a:b + 1]), self.options.world // stages, held, budgeted

    def of(self, a: int, b: int, stages: int, k: int = 0) -> float:
        """Layers ``a .. b`` as stage ``k`` of ``stages`` on ``world / stages`` devices (``per``), with stage ``k``'s
        microbatches in flight."""
        return self.holding(a, b, stages, inflight("1f1b", k, stages, self.m))

    def holding(self, a: int, b: int, stages: int, held: int, budgeted: bool = True) -> float:
        """Layers ``a .. b`` as a stage of ``stages`` holding ``held`` microbatches in flight (``budgeted`` False:
        planned without the memory budget, nothing recomputed)."""
        from ..planner.core import SearchError
        from ..planner.solve import MemoryBudgetError

        per = self.options.world // stages
        key = self._key(a, b, stages, held, budgeted)
        if key not in self.memo:
            parts = [r for r in ((0, a - 1), (a, b), (b + 1, len(self.names) - 1)) if r[0] <= r[1]]
            st = split(self.cap, parts)[parts.index((a, b))]
            self.plans += 1
            opts = self.options if budgeted else dataclasses.replace(self.options, memory_gb=None)
            try:  # planned with its microbatches in flight: a plan found fits with them
                p = stage_plan(st.cap, per, opts, held, fallback=False)
            except (MemoryBudgetError, SearchError):  # no plan of this stage fits (or none was found): never chosen
                self.memo[key] = (math.inf, math.inf, 0.0, 0.0)
                return math.inf
            sends = sends_s(self.facts, st, per, self.profile)
            self.memo[key] = (microbatch_s(p) + sends, stage_memory(p, held), sync_s(p), sends)
        return self.memo[key][0]

    def bound(self, groups: int, schedule: str, v: int) -> float:
        """A lower bound of the step of every cut the search considers for ``groups`` rank groups and ``v`` stages
        each: some stage holds at least ``L = ceil(n / (groups v))`` layers (``floor`` for the even cut of the
        virtual stages), and a stage of ``L`` layers costs at least what a middle stage of ``L`` layers costs without
        its sends (a stage holding the embedding or the head does more; one of more layers, more: costs grow with
        the ops); with every stage at that, the step (``pipeline_step``, syncs left out) bounds it.  One middle stage
        planned without the memory budget: the budget and the microbatches in flight only take plans away, so its
        time bounds the stage's under any, and it is the cheapest to plan, with no recomputation search
        (Llama-3-70B's 40 layers on 32 devices: 108 s under the budget with one microbatch, 146 s with two); 0 when
        the layers leave no middle stage."""
        n = len(self.names)
        length = math.ceil(n / groups) if v == 1 else n // (groups * v)
        if length < 1 or length + 2 > n:
            return 0.0
        t = self.holding(1, length, groups, 1, budgeted=False)
        if not math.isfinite(t):
            return math.inf
        least = t - self.memo[self._key(1, length, groups, 1, False)][3]
        return pipeline_step([least] * v, [0.0] * v, 1, self.m, bubble_fraction(schedule, groups, self.m, v))

    def step(self, cut: Sequence[tuple[int, int]], groups: int, schedule: str, v: int) -> float:
        """The step of the pipeline of ``cut`` on ``groups`` rank groups (``pipeline_step``, and its tied weights'
        gradient sums: ``tie_s``)."""
        return pipeline_step([self.of(a, b, groups) for a, b in cut], [self.sync(a, b, groups) for a, b in cut],
                             groups, self.m, bubble_fraction(schedule, groups, self.m, v)) + sum(
            tie_s(t["bytes"], len(t["stages"]), self.profile) for t in tied_weights(self.cap, cut, groups))

    def sync(self, a: int, b: int, stages: int, k: int = 0) -> float:
        """The gradient synchronisation of layers ``a .. b`` as a stage (``of`` first plans it)."""
        self.of(a, b, stages, k)
        return self.memo[self._key(a, b, stages, inflight("1f1b", k, stages, self.m))][2]


def search_pipeline(capture_at: Callable[[int], Captured], batch: int, world: int, options: PlanOptions,
                    say: Callable[[str], None] = lambda line: None, stages: int | None = None,
                    incumbent: float | None = None) -> tuple[Plan | None, list[dict[str, Any]]]:
    """The fastest pipelined plan over the stage counts ``S`` (divisors of ``world``, 2 up to the layers), the
    microbatch counts ``M`` (divisors of ``batch`` from ``S`` to ``4 S``; ``capture_at(M)`` captures at that
    microbatch), the schedules and the cuts, or None when none is faster than ``incumbent`` (the plan without
    stages).

    Each stage's time per microbatch is its own plan on ``world / S`` devices, the planner choosing its submesh, plus
    its sends (``StageCosts``). Under 1F1B the cut is the best of every cut whose stages are near the even length
    (``best_cut`` over ``stage_lengths``), the step ``(M + S - 1)`` times the slowest stage; with 2 virtual stages per
    rank group (``2 S`` stages, the even cut: ``even_bounds``) under zero bubble, whose bubble is the least of the
    interleaved schedules for the same stages (``bubble_fraction``), ``M`` times the slowest group over ``1 -
    bubble``; each plus the gradient synchronisation once (``pipeline_step``) and the tied weights' sums. Each stage is
    planned with its microbatches in flight (``inflight``, counted as the first stage's: the most), so its
    recomputation and layout are chosen to fit them (``stage_plan``); a stage no plan of which fits them costs
    infinity.

    Candidates go in the order of their lower bounds (``StageCosts.bound``, one middle stage planned each); one whose
    bound is no less than the best step so far (or ``incumbent``) is pruned unsearched. Every candidate is in the
    list: its modelled step (``step_time_s``), or its bound and ``pruned`` (``Plan.pipeline["searched"]`` keeps
    it); only the fastest is planned whole (``plan_pipeline``). ``stages``: only that stage count."""
    profile = options.profile if isinstance(options.profile, Profile) else load_profile(options.profile)
    best: tuple[float, StageCosts, int, int, str, int, list[tuple[int, int]]] | None = None
    searched: list[dict[str, Any]] = []
    candidates: list[tuple[float, int, int, str, int, StageCosts]] = []
    for m in [d for d in range(1, batch + 1) if batch % d == 0]:
        degrees = [s for s in range(2, world + 1) if world % s == 0 and s <= m <= 4 * s and stages in (None, s)]
        if not degrees:
            continue
        costs = StageCosts(capture_at(m), options, profile, m)
        n = len(costs.names)
        for s in [d for d in degrees if d <= n]:
            for schedule, v in [("1f1b", 1)] + ([("zero-bubble", 2)] if 2 * s <= n else []):
                candidates.append((costs.bound(s, schedule, v), s, m, schedule, v, costs))
    floor = incumbent if incumbent is not None else math.inf
    for bound, s, m, schedule, v, costs in sorted(candidates, key=lambda c: (c[0], c[1], c[2], c[4])):
        n = len(costs.names)
        entry = {"stages": s, "microbatches": m, "schedule": schedule, "virtual_stages": v}
        if bound >= min(floor, best[0] if best is not None else math.inf):
            searched.append({**entry, "bound_s": bound, "pruned": True})
            continue
        if v == 1:
            cut, _ = best_cut(n, s, functools.partial(costs.of, stages=s), stage_lengths(n, s))
        else:
            cut = even_bounds(n, s * v)
        step = costs.step(cut, s, schedule, v)
        searched.append({**entry, "bound_s": bound, "step_time_s": step,
                         "units": [[costs.names[a], costs.names[b]] for a, b in cut]})
        say(f"pipeline {s} stages x {v} x {m} microbatches, {schedule}: {step:.4g} s")
        if math.isfinite(step) and (best is None or step < best[0]):
            best = (step, costs, s, m, schedule, v, cut)
    if best is None or best[0] >= floor:
        return None, searched
    _, costs, s, m, schedule, v, cut = best
    _, _, top = plan_pipeline(costs.cap, world, s, m, schedule, options, virtual_stages=v, bounds=cut,
                              facts=costs.facts)
    assert top.pipeline is not None
    top.pipeline["searched"] = searched
    return top, searched
