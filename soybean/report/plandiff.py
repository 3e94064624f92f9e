"""What differs between two plans: their setting, every tensor's tiling, and their modelled cost.

``diff(a, b)`` reads two ``Plan`` records only (no model): the setting (devices, mesh, objective, profile, model
fingerprint, precision, input contract, topology, recomputed layers), the tiling of every parameter and buffer
(``params``), user input (``inputs``) and op or shared use (``nodes``: input and output tilings, and the axes
over which a shared use sums partial gradients), the algorithm each collective runs (``Plan.algorithms``, by
collective, mesh axis and message bytes), then every ``cost`` and ``memory`` term, then pipeline stages (their
schedule, and stage by stage its layers, ranks, mesh and its own plan's differences).  A name present in one
plan only is listed as such.  Two plans are the same when no line results: what varies run to run (the
solver's time and record, the meshes tried, the baselines, the per-layer table derived from the tilings) is
not compared.  ``soybean diff`` prints the lines and exits 1 when there are any, 0 when none (as ``diff``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..plan import Plan

# The setting fields compared, in the order reported.
SETTING = ("devices", "mesh", "objective", "profile", "fingerprint", "precision", "local_batch", "gpus_per_node",
           "recompute", "collectives", "outputs")


def _value(x: Any) -> str:
    if isinstance(x, list) and x and all(isinstance(i, int) for i in x):
        return "x".join(map(str, x))  # a mesh shape
    if isinstance(x, list):
        return ", ".join(map(str, x)) or "none"
    return str(x)


def _tiling(t: list[str] | None) -> str:
    return ",".join(t) if t is not None else "(absent)"


def _node(rec: Mapping[str, Any] | None) -> str:
    """An op's or shared use's record, in parentheses: ``(S(0) R -> S(0))``, with its variant if any
    (``(S(2) R R -> S(2) zigzag)``)."""
    if rec is None:
        return "(absent)"
    text = " ".join(",".join(t) for t in rec.get("in", [])) + " -> " + " ".join(",".join(t) for t in rec.get("out", []))
    axes = rec.get("grad_partial", [[]])[0] if rec.get("grad_partial") else []
    text += f" {rec['variant']}" if rec.get("variant") else ""  # the same tilings run another way (zig-zag rows)
    return f"({text}" + (f", grad summed on axes {','.join(map(str, axes))})" if axes else ")")


def _number(x: float | None) -> str:
    return f"{x:.6g}" if x is not None else "(absent)"


def _tilings(kind: str, a: Mapping[str, Any], b: Mapping[str, Any], show: Any) -> list[str]:
    """One line per name whose record differs (or is in one plan only), names in sorted order."""
    return [f"{kind} {name}: {show(a.get(name))} -> {show(b.get(name))}"
            for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


def _sig(x: float | None) -> float | None:
    """6 significant digits, as a saved plan keeps them (``plan.Plan.to_dict``)."""
    return float(f"{x:.6g}") if x is not None else None


def _costs(kind: str, a: Mapping[str, float], b: Mapping[str, float]) -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = _sig(a.get(k)), _sig(b.get(k))
        if x == y:
            continue
        rel = f" ({(y - x) / abs(x):+.1%})" if x and y is not None else ""
        out.append(f"{kind} {k}: {_number(x)} -> {_number(y)}{rel}")
    return out


def diff(a: Plan, b: Plan) -> list[str]:
    """The lines that tell ``a`` from ``b`` (module docstring), ``a``'s side first on each; empty when the
    plans are the same; a last line counts the differing tilings."""
    out = [f"{f}: {_value(getattr(a, f))} -> {_value(getattr(b, f))}" for f in SETTING
           if getattr(a, f) != getattr(b, f)]
    params = _tilings("param", a.params, b.params, _tiling)
    inputs = _tilings("input", a.inputs, b.inputs, _tiling)
    nodes = _tilings("node", a.nodes, b.nodes, _node)
    out += params + inputs + nodes
    algos = {f"{c}[axis {ax}, {m} B, {ph}]": f"{x[0]}" for (c, ax, m, ph), x in a.algorithms().items()}
    algos_b = {f"{c}[axis {ax}, {m} B, {ph}]": f"{x[0]}" for (c, ax, m, ph), x in b.algorithms().items()}
    out += [f"collective {k}: {algos.get(k, '(absent)')} -> {algos_b.get(k, '(absent)')}"
            for k in sorted(set(algos) | set(algos_b)) if algos.get(k) != algos_b.get(k)]
    out += _costs("cost", a.cost, b.cost) + _costs("memory", a.memory, b.memory)
    out += _stages(a.pipeline, b.pipeline)
    if params or inputs or nodes:
        out.append(f"{len(params)} of {len(set(a.params) | set(b.params))} parameters, {len(inputs)} of "
                   f"{len(set(a.inputs) | set(b.inputs))} inputs, {len(nodes)} of {len(set(a.nodes) | set(b.nodes))} "
                   "ops and shared uses tiled differently")
    return out


# A pipelined plan's schedule fields compared, and each stage's (``Plan.pipeline``).
PIPELINE = ("schedule", "microbatches", "virtual_stages")
STAGE = ("units", "ranks", "mesh")


def _stages(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> list[str]:
    """Pipeline stages: present in one plan only, their schedule, and stage by stage its layers, ranks and mesh,
    then its own plan's differences (``diff``), each line prefixed with the stage."""
    if a is None and b is None:
        return []
    if a is None or b is None:
        n = len((a or b or {}).get("stages", []))
        return [f"pipeline: {'none' if a is None else f'{n} stages'} -> {'none' if b is None else f'{n} stages'}"]
    out = [f"pipeline {f}: {_value(a.get(f))} -> {_value(b.get(f))}" for f in PIPELINE if a.get(f) != b.get(f)]
    sa, sb = a["stages"], b["stages"]
    if len(sa) != len(sb):
        out.append(f"pipeline stages: {len(sa)} -> {len(sb)}")
    for k, (x, y) in enumerate(zip(sa, sb)):
        out += [f"stage {k} {f}: {_value(x[f])} -> {_value(y[f])}" for f in STAGE if x[f] != y[f]]
        out += [f"stage {k} {line}" for line in diff(Plan.from_dict(x["plan"]), Plan.from_dict(y["plan"]))]
    return out
