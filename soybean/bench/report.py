"""The bench's report as a reader sees it: one row per variant, then the plans, the candidates and the rank
correlation (``format_table``); ``harness.run_bench`` makes the report."""
from __future__ import annotations

from typing import Any

from .variants import VARIANTS

W = max(len(v) for v in VARIANTS)  # the variant column's width


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    """``x`` formatted, or ``-`` for a null."""
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds (one decimal, or 3 significant digits below 1 ms), or ``-``."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f}" if seconds >= 1e-3 else f"{seconds * 1e3:.3g}"


def _brief_params(params: dict[str, list[str]], limit: int = 8) -> str:
    """``inp.weight S(0), out.weight S(1), ...`` for the first ``limit`` parameters."""
    items = [f"{k} {','.join(v)}" for k, v in params.items()]
    more = f", ... (+{len(items) - limit})" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def brief_plan(p: dict[str, Any]) -> str:
    """A plan summary (``harness.plan_summary``) in one line: its parameters' tilings, then where it places regions
    or stages (a placed or pipelined plan tiles its parameters per region or stage, so its own list may be empty)."""
    parts = [_brief_params(p["params"])] if p["params"] else []
    if "placement" in p:
        parts.append(f"{p['placement_groups']} groups: " + "; ".join(
            f"{'+'.join(r['units'])} on ranks {r['ranks']}" for r in p["placement"]["regions"]))
    if "pipeline" in p:
        parts.append(f"{p['stages']} stages ({p['pipeline']['schedule']}): " + "; ".join(
            f"ranks {st['ranks']}" for st in p["pipeline"]["stages"]))
    return " | ".join(parts) or "no parameters"


def format_table(report: dict[str, Any]) -> str:
    """The human-readable report: one row per variant, then the plans and the rank correlation."""
    m = report["machine"]
    args = " ".join(f"{k}={v}" for k, v in report["args"].items())
    lines = [
        f"{report['model']} {args} | {report['devices']} ranks | "
        f"median of {report['steps']} steps after {report['warmup']} warm-up, "
        + ("variants one after the other" if report.get("rounds") == 1 else "variants taking turns")
        + f" | profile {report['profile']}",
        f"machine: {m['cores']} cores ({m['cpu']}), load {_fmt(m['loadavg_1m'], '.2f')}, torch {m['torch']}, "
        f"serial {m['serial_threads']} threads, {m['rank_threads']} thread per rank, {m['backend']}",
        "",
        f"{'variant':<{W}} {'step ms':>9} {'vs serial':>10} {'vs ddp':>8} {'predicted ms':>13}  note",
    ]
    for v in VARIANTS:
        t = report["step_s"][v]
        note = report["reasons"].get(v) or report["notes"].get(v, "")
        lines.append(f"{v:<{W}} {_ms(t):>9} {_fmt(report['speedup_vs_serial'][v], '.2f', 'x'):>10} "
                     f"{_fmt(report['speedup_vs_ddp'][v], '.2f', 'x'):>8} "
                     f"{_ms(report['predicted_step_s'].get(v)):>13}  {note}".rstrip())
    lines.append("(vs serial / vs ddp: speedup, that time divided by this one; above 1x is faster)")
    lines.append("")
    if report["tp_layout"]:
        lines.append("tp layout: " + ", ".join(f"{k} {s}" for k, s in report["tp_layout"].items()))
    for v, p in report["plans"].items():
        lines.append(f"{v} plan: mesh {p['mesh']}: {brief_plan(p)}")
    c = report["candidates"]
    for v, twin in c["same_plan"].items():
        lines.append(f"{v} runs the same plan as {twin}: the two count as one candidate, timed as the mean of both")
    if c["distinct"]:
        lines.append(f"candidates: predicted fastest {c['predicted_fastest']}, "
                     f"measured fastest {c['measured_fastest']}; prediction error "
                     + ", ".join(f"{v} {e:+.0%}" for v, e in report["prediction_error"].items()))
    sig = c.get("significance")
    if sig is not None and sig["versus"]:
        def ratio(v: str, r: dict[str, Any]) -> str:
            ci = f" (95% {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})" if r["ci95"] else " (too few steps)"
            return f"{v} {r['ratio']:.3f}x{ci}"

        lines.append(f"paired steps, against {c['predicted_fastest']}: "
                     + ", ".join(ratio(v, r) for v, r in sig["versus"].items()) + f": {sig['verdict']}")
    sp = report["spearman"]
    lines.append("Spearman rank correlation, predicted vs measured step time over "
                 f"{', '.join(sp['variants']) or 'no plans'}: "
                 f"{_fmt(sp['rho'], '.2f')} (n={len(sp['variants'])})")
    return "\n".join(lines) + "\n"
