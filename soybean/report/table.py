"""Human-readable reports of a plan: the per-layer table and totals beside the baselines."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..cost.memory import fmt_memory
from ..plan import Plan


def _bytes(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def _total(name: str, cost: Mapping[str, Any]) -> str:
    """One line of totals: the plan's or a baseline's (or why a baseline cannot run), with the
    baseline's mesh when it has one."""
    if "infeasible" in cost:
        return f"{name:<16} infeasible: {cost['infeasible']}"
    mesh = f"   mesh {'x'.join(map(str, cost['mesh']))}" if cost.get("mesh") else ""
    staged = (f", {cost['stages']} stages, {cost['microbatches']} microbatches, {cost['schedule']}"
              if "stages" in cost else "")
    checkpoint = f", {cost['recompute']} checkpointing" if cost.get("recompute") else ""
    return (f"{name:<16} comm {_bytes(cost['comm_bytes']):>10}/device/step   step {cost['step_time_s'] * 1e3:10.3f} ms"
            + mesh + staged + checkpoint)


def table(plan: Plan) -> str:
    head = ["layer", "op", "weight", "input", "output", "collectives", "bytes"]
    rows = [[r["layer"], r["op"].replace("aten.", "").replace(".default", ""), r["weight"], r["input"], r["output"],
             ", ".join(r["collectives"]) or "-", _bytes(r["bytes"])] for r in plan.layers]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    widths[5] = min(widths[5], 60)
    lines = [f"soybean plan: {plan.devices} devices, mesh {'x'.join(map(str, plan.mesh))}, "
             f"objective {plan.objective}, profile {plan.profile}", ""]
    lines.append(_row(head, widths))
    lines.append(_row(["-" * w for w in widths], widths))
    lines += [_row(r, widths) for r in rows]
    lines.append("")
    c = plan.cost
    lines.append(_total("plan", c))
    if "compute_s" in c:
        lines.append(f"{'':<16} = compute {c['compute_s'] * 1e3:.3f} ms + comm {c.get('comm_s', 0) * 1e3:.3f} ms"
                     f" - gradient sync hidden behind backward {c.get('hidden_s', 0) * 1e3:.3f} ms")
    m = plan.memory
    if m and "activation_phase" in m:
        both = (f"parameters {fmt_memory(m['parameters'])} + optimizer states {fmt_memory(m['optimizer_states'])}"
                f" + inputs and buffers {fmt_memory(m['inputs_and_buffers'])}")
        lines.append(f"{'memory':<16} {fmt_memory(m['peak']):>10}/device (modelled peak: the larger phase)")
        lines.append(f"{'':<16} end of forward {fmt_memory(m['activation_phase'])} = {both} + activations kept "
                     f"{fmt_memory(m['activations'])} + backward transient {fmt_memory(m['backward_transient'])}"
                     f" + recompute buffers {fmt_memory(m['recompute_buffers'])}")
        lines.append(f"{'':<16} after backward {fmt_memory(m['gradient_phase'])} = {both} + gradients "
                     f"{fmt_memory(m['gradients'])} + step temporaries {fmt_memory(m['optimizer_temporaries'])}"
                     f" + gradient-sync buckets {fmt_memory(m['collective_buffers'])}")
    if plan.reshards:
        used = Counter((r["collective"], r["algorithm"]) for r in plan.reshards)
        own = [f"{n} {c} by {a}" for (c, a), n in sorted(used.items()) if a != "backend"]
        backend = sum(n for (_, a), n in used.items() if a == "backend")
        lines.append(f"{'collectives':<16} {plan.collectives}: " + ", ".join(own + [f"{backend} by the backend"]))
    for r in plan.moe:
        how = (f"split {r['degree']}-way over mesh axes {r['axes']}" + (f", rows moved by all-to-all on {r['dispatch']}"
               if r["dispatch"] else "") + (f", a pending sum on {r['partial']}" if r["partial"] else "")
               if r["axes"] else "every expert on every rank" if r.get("ffn_axes") else "whole on every rank")
        if r.get("ffn_axes"):
            how += f"; each split inside along its FFN dim on {r['ffn_axes']} (tensor parallelism, a pending sum)"
        lines.append(f"{'experts':<16} {r['layer']}: {r['experts']} experts (top-{r['top_k']}), {how}")
    if plan.recompute:
        shown = ", ".join(plan.recompute[:4]) + (f", ... ({len(plan.recompute)} in all)"
                                                 if len(plan.recompute) > 4 else "")
        lines.append(f"{'recompute':<16} {len(plan.recompute)} units rerun in backward: {shown}")
    for k, v in plan.baselines.items():
        lines.append(_total(k, v))
    if plan.meshes and len(plan.meshes) > 1:
        lines.append("meshes tried: " + ", ".join(
            f"{'x'.join(map(str, m['mesh']))}={m['objective']:.4g}" if "objective" in m
            else f"{'x'.join(map(str, m['mesh']))}>={m['bound']:.4g} (bound, not solved)" for m in plan.meshes))
    s = plan.solver
    lines.append(f"solver {s.get('name')}: {s.get('status')} in {s.get('seconds', 0):.2f} s "
                 f"(objective {s.get('objective', 0):.6g}, bound {s.get('bound', 0):.6g}){_unproven(s)}")
    lines.append("replicate fallbacks: " + (", ".join(plan.fallback_ops) if plan.fallback_ops else "none"))
    return "\n".join(lines) + "\n"


# A plan further than this from its bound is flagged on the solver line: the user asked for 1e-4 by default.
UNPROVEN_GAP = 0.01


def _unproven(solver: dict) -> str:
    """What the solver line adds when the plan is not proven near optimal: the gap, or that there is no bound (a
    search stopped at its time limit before any bound: a faster plan may exist)."""
    bound, gap = solver.get("bound"), solver.get("gap")
    if isinstance(bound, (int, float)) and bound == float("-inf"):
        return ": no bound, the search stopped at its time limit; a faster plan may exist (give more --time-limit)"
    if isinstance(gap, (int, float)) and gap > UNPROVEN_GAP:
        return f": gap {gap:.2%}, a plan up to that much faster may exist"
    return ""


def _ranks(ranks: list[int]) -> str:
    """Ranks as a range when contiguous (``0-7``), else listed."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _columns(head: list[str], rows: list[list[str]]) -> list[str]:
    """``head`` and ``rows`` as lines of left-aligned columns two spaces apart (a plan in parts, one row each)."""
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head, *rows]]


def placement_table(plan: Plan) -> str:
    """A placed plan (``Plan.placement``): one row per region (its modules, the graph segment whose branches it
    runs, ranks, mesh, modelled seconds, its sends), then which regions run at the same time and the modelled
    step."""
    place = plan.placement
    assert place is not None
    head = ["region", "units", "segment", "ranks", "mesh", "step", "sends"]
    rows = [[str(k), ", ".join(r["units"]) or "-", "-" if r["segment"] is None else str(r["segment"]),
             _ranks(r["ranks"]), "x".join(map(str, r["mesh"])), f"{r['step_s'] * 1e3:.4g} ms",
             f"{len(r['sends'])} ({_bytes(r['send_bytes'])}, {r['transfer_s'] * 1e3:.3g} ms)" if r["sends"] else "-"]
            for k, r in enumerate(place["regions"])]
    lines = _columns(head, rows)
    for seg in place["segments"]:
        together = [k for k, r in enumerate(place["regions"]) if r["segment"] == seg["segment"]]
        if seg["placed"]:
            lines.append(f"segment {seg['segment']}: {seg['branches']} branches on {len(seg['parts'])} groups of "
                         f"{'+'.join(map(str, seg['sizes']))} devices, regions {', '.join(map(str, together))} at the "
                         f"same time: {seg['step_s'] * 1e3:.4g} ms against {seg['unplaced_s'] * 1e3:.4g} ms on every "
                         f"device ({seg['options']} ways priced)")
        else:
            lines.append(f"segment {seg['segment']}: {seg['branches']} branches kept on every device "
                         f"({seg['step_s'] * 1e3:.4g} ms)")
    for t in place.get("tied", []):
        over = f"across ranks {_ranks(t['ranks'])}" if t["ranks"] else "on each rank"
        lines.append(f"tied weight {t['param']} in regions {', '.join(map(str, t['regions']))}: its gradient "
                     f"({_bytes(t['bytes'])}) summed {over} once per step")
    proven = "the best proven (gap 0" if place["gap"] is not None else \
        "the best segment by segment (a weight shared across segments priced in each"
    lines.append(f"step {plan.cost['step_time_s'] * 1e3:.4g} ms (modelled, {plan.profile}); {place['options']} ways "
                 f"priced, {proven}; the regions' own plans within {place['region_gap']:.2%})")
    if place.get("without_placement_s") is not None:
        lines.append(f"without placement: {place['without_placement_s'] * 1e3:.4g} ms")
    lines += [_total(k, v) for k, v in plan.baselines.items()]
    return "\n".join(lines) + "\n"


def pipeline_table(plan: Plan) -> str:
    """A pipelined plan (``Plan.pipeline``): one row per stage (its layers, ranks, mesh, modelled seconds per
    microbatch, peak memory per device with its microbatches in flight, the values it sends on), then the schedule
    and the modelled step."""
    pipe = plan.pipeline
    assert pipe is not None
    head = ["stage", "units", "ranks", "mesh", "per microbatch", "memory", "sends"]
    rows = [[str(k), f"{st['units'][0]} .. {st['units'][1]}", _ranks(st["ranks"]),
             "x".join(map(str, st["mesh"])), f"{st['microbatch_s'] * 1e3:.4g} ms",
             fmt_memory(st.get("memory_bytes", 0.0)), str(len(st["sends"]))]
            for k, st in enumerate(pipe["stages"])]
    lines = _columns(head, rows)
    lines.append(f"schedule {pipe['schedule']}, {pipe['microbatches']} microbatches, bubble {pipe['bubble']:.1%}; "
                 f"step {plan.cost['step_time_s'] * 1e3:.4g} ms (modelled, {plan.profile})")
    for t in pipe.get("tied", []):
        lines.append(f"tied weight {t['param']} in stages {', '.join(map(str, t['stages']))}: its gradient "
                     f"({_bytes(t['bytes'])}) summed across them once per step")
    if pipe.get("without_stages_s") is not None:
        lines.append(f"without stages: {pipe['without_stages_s'] * 1e3:.4g} ms")
    elif pipe.get("without_stages_bound_s") is not None:  # pruned by the pipeline's step (``api.auto_plan``)
        lines.append(f"without stages: at least {pipe['without_stages_bound_s'] * 1e3:.4g} ms (bound: not planned)")
    lines += [_total(k, v) for k, v in plan.baselines.items()]
    return "\n".join(lines) + "\n"


def pieces_table(plan: Plan) -> str:
    """A plan made of pieces (``soybean.run.pieces``): why and how the model was captured, then each piece's ops,
    parameters and modelled step, and its own table."""
    from ..run.pieces import piece_plans

    assert plan.pieces is not None
    rows = plan.pieces["graphs"]
    lines = [f"soybean plan: {plan.devices} devices, captured by dynamo in {len(rows)} pieces ({plan.pieces['why']}); "
             "parameters stored whole, each piece's work split", ""]
    for k, (row, part) in enumerate(zip(rows, piece_plans(plan))):
        lines.append(f"== piece {k}: {row['ops']} ops, {len(row['params'])} parameters, "
                     f"{part.cost.get('step_time_s', 0.0) * 1e3:.3f} ms modelled")
        lines.append(table(part))
    lines.append(f"pieces together: {plan.cost.get('step_time_s', 0.0) * 1e3:.3f} ms modelled per step")
    return "\n".join(lines) + "\n"
