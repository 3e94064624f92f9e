"""A pipelined plan: stages cut from the capture (``soybean.stages``), each planned on its own submesh by the
planner, and the schedule priced on top.

Priced per microbatch: each stage's step on its submesh (its own plan's modelled ``step_time_s``: forward,
backward and communication of one microbatch, the capture being the microbatch's) plus the transfers it sends
(every boundary value forward and its gradient back, ``alpha + bytes * beta`` of the profile's link).  A rank group
runs its stages one after the other (``virtual_stages`` of them under the interleaved schedule), and the schedule
idles a fraction ``bubble = (p - 1) / (v m + p - 1)`` of the step (GPipe and 1F1B: ``v = 1``), so the step is
``m`` times the slowest group's time over ``1 - bubble``: ``(m + p - 1)`` slots of the slowest stage when
``v = 1``.

This first version takes the number of stages as given and cuts the layers evenly (``stages.even_bounds``);
the search over stage counts, cuts, submeshes and schedules with the tiling is issue 18's next step.
"""
from __future__ import annotations

from typing import Any

import torch

from .capture import Captured
from .cost.profiles import Profile, load_profile
from .options import PlanOptions
from .plan import Plan
from .stages import Stage, even_bounds, layers, split


def plan_pipeline(cap: Captured, world: int, stages: int, microbatches: int, schedule: str,
                  options: PlanOptions, virtual_stages: int = 1) -> tuple[list[Stage], list[Plan], Plan]:
    """The stages of ``cap`` (captured at the microbatch), each one's plan on ``world // stages`` devices, and the
    pipelined plan (``Plan.pipeline`` holding the stages' plans).  ``stages`` is the pipeline's depth (rank
    groups); with ``virtual_stages`` ``v`` the layers are cut into ``stages * v`` stages, stage ``i`` on group
    ``i % stages`` (the interleaved schedule)."""
    from .pipelined import MULTI_STAGE, schedule_class
    from .planner import plan

    schedule_class(schedule)  # an unknown name fails here, before any planning
    if stages < 2 or world % stages:
        raise ValueError(f"{stages} pipeline stages on {world} devices: use a number of at least 2 that divides "
                         f"the devices ({[s for s in range(2, world + 1) if world % s == 0]})")
    if (virtual_stages > 1) != (schedule in MULTI_STAGE):
        raise ValueError(f"schedule {schedule} with {virtual_stages} virtual stages per rank: "
                         f"{', '.join(MULTI_STAGE)} runs 2 or more per rank, the others one")
    names = layers(cap)
    total = stages * virtual_stages
    bounds = even_bounds(len(names), total)
    cut = split(cap, bounds)
    per = world // stages
    plans = [plan(None, (), per, options=options, baselines=False, captured=st.cap) for st in cut]
    profile = options.profile if isinstance(options.profile, Profile) else load_profile(options.profile)
    per_mb = [p.cost["step_time_s"] + _transfer_s(cap, st, profile.alpha, profile.beta) for p, st in zip(plans, cut)]
    # each rank group runs its stages one after the other per microbatch; the schedule adds (p - 1) / v slots
    group_s = [sum(per_mb[i] for i in range(g, total, stages)) for g in range(stages)]
    bubble = (stages - 1) / (virtual_stages * microbatches + stages - 1)
    step = max(group_s) * microbatches / (1 - bubble)
    record: dict[str, Any] = {
        "schedule": schedule, "microbatches": microbatches, "virtual_stages": virtual_stages, "bubble": bubble,
        "stages": [{"units": [names[a], names[b]], "layers": [a, b],
                    "ranks": list(range((k % stages) * per, (k % stages + 1) * per)), "mesh": list(p.mesh),
                    "microbatch_s": t, "sends": st.returns, "plan": p.to_dict()}
                   for k, (st, p, t, (a, b)) in enumerate(zip(cut, plans, per_mb, bounds))],
    }
    top = Plan(devices=world, mesh=[stages, per], objective=options.objective, profile=plans[0].profile,
               fingerprint=cap.fingerprint, params={}, inputs={}, nodes={},
               cost={"step_time_s": step, "compute_s": sum(p.cost.get("compute_s", 0.0) for p in plans) * microbatches},
               precision=cap.precision, pipeline=record)
    return cut, plans, top


def _transfer_s(cap: Captured, st: Stage, alpha: float, beta: float) -> float:
    """Seconds stage ``st`` spends sending its boundary values forward and receiving their gradients back, per
    microbatch (none for the last stage)."""
    vals = {n.name: n.meta.get("val") for n in cap.graph.nodes}
    total = 0.0
    for name in st.returns:
        v = vals.get(name)
        if isinstance(v, torch.Tensor):
            b = v.numel() * v.element_size()
            total += (alpha + b * beta) * (2 if v.requires_grad or v.is_floating_point() else 1)
    return total
