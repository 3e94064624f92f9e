"""A plan as a picture: plain SVG (or an HTML page around it), one row per layer, one box per module.

Layout.  The rows of ``explain.by_module`` (modules in the order their ops run) are grouped into *bands*: a
module's layer (``graph.layer_of``: ``blocks.3``), else its top-level module (``lm_head``), else the inputs, the
model's own ops or the output.  Bands run top to bottom in order of first appearance, their boxes left to
right, so a 12-layer transformer is 12 rows of the same dozen boxes, whatever its op count.

A box shows its module's tensors as *chips*, one stripe per mesh axis coloured by that axis' placement
(``R`` grey, ``S(d)`` a colour per dim, ``P`` yellow): its parameters (``W`` weight, ``b`` bias) and ``out``, the
tiling its last op returns.  Each collective it pays for (``explain.Row.collectives``: the edges into its ops
and inside them) is counted on a red badge by kind, every one listed in the badge's tooltip.  Dataflow between
boxes of one band is an arc, between consecutive bands a line; red when the edge runs a collective.  A bar
under each box, and one right of each band, is its time, compute (blue) against communication (red), to one
scale per figure.  At the bottom, the per-device step (SPMD: every rank runs the same program): compute,
blocking communication, gradient sync, and the part of the sync hidden behind backward, to the step time
``T = comm_s + compute_s - hidden_s``.
"""
from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from ..cost.memory import fmt_memory
from ..graph import layer_of
from ..tiling import Partial, Placement, Shard
from .explain import INPUTS, MODEL, OUTPUTS, Explanation, Row, by_module, format_text, short_op

# Sizes in px.
BOX_W, BOX_H, GAP = 124, 104, 14
LABEL_W, ARC_H, BAND_GAP = 132, 36, 26
BAR_W = 170
FONT = "font-family:Helvetica,Arial,sans-serif"

COMPUTE, COMM, SYNC, HIDDEN = "#4e79a7", "#e15759", "#f28e2b", "#ffbe7d"
SHARD = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22")
REPLICATE, PARTIAL = "#c7c7c7", "#edc948"
ABBREV = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A", "halo": "halo"}


def placement_colour(p: Placement) -> str:
    if isinstance(p, Shard):
        return SHARD[p.dim % len(SHARD)]
    return PARTIAL if isinstance(p, Partial) else REPLICATE


@dataclass
class _Box:
    module: str
    rows: list[Row]
    band: int
    col: int
    x: float = 0.0
    y: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(r.total_s for r in self.rows)

    @property
    def comm_s(self) -> float:
        return sum(r.comm_s for r in self.rows)


@dataclass
class _Band:
    name: str
    boxes: list[_Box] = field(default_factory=list)
    y: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(b.total_s for b in self.boxes)

    @property
    def comm_s(self) -> float:
        return sum(b.comm_s for b in self.boxes)


def band_of(module: str) -> str:
    """The band (row of the picture) of a module: its layer, else its top-level module."""
    if module in (INPUTS, OUTPUTS, MODEL):
        return module
    return layer_of(module) or module.split(".")[0]


def layout(ex: Explanation) -> list[_Band]:
    """Bands in order of first appearance, each with its modules' boxes placed left to right."""
    bands: dict[str, _Band] = {}
    for module, rows in by_module(ex.rows):
        band = bands.setdefault(band_of(module), _Band(band_of(module)))
        band.boxes.append(_Box(module, rows, len(bands) - 1, len(band.boxes)))
    y = 150.0
    out = list(bands.values())
    for i, band in enumerate(out):
        band.y = y
        for b in band.boxes:
            b.band = i
            b.x, b.y = LABEL_W + b.col * (BOX_W + GAP), y + ARC_H
        y += ARC_H + BOX_H + BAND_GAP
    return out


def _fit(text: str, width: float, size: float = 11.0, keep_end: bool = False) -> str:
    """``text`` cut with an ellipsis to about ``width`` px at font ``size`` (``keep_end``: its start is cut, so a
    module path keeps its last, distinguishing parts: ``\u2026former.h.11``)."""
    n = max(3, int(width / (0.6 * size)))
    if len(text) <= n:
        return text
    return "\u2026" + text[len(text) - n + 1:] if keep_end else text[:n - 1] + "\u2026"


class _Svg:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, s: str) -> None:
        self.parts.append(s)

    def text(self, x: float, y: float, s: str, size: float = 11, colour: str = "#222", anchor: str = "start",
             weight: str = "normal", tip: str = "") -> None:
        title = f"<title>{escape(tip)}</title>" if tip else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{colour}" text-anchor="{anchor}" '
                 f'font-weight="{weight}">{title}{escape(s)}</text>')

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str = "none", tip: str = "",
             rx: float = 0.0, extra: str = "") -> None:
        title = f"<title>{escape(tip)}</title>" if tip else ""
        self.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h:.1f}" fill="{fill}" '
                 f'stroke="{stroke}" rx="{rx}"{extra}>{title}</rect>')


def _chip(out: _Svg, x: float, y: float, tiling: tuple, label: str, tip: str) -> float:
    """A tensor's chip: one stripe per mesh axis; returns its width with its label."""
    w = 7.0
    for a, p in enumerate(tiling):
        out.rect(x + a * w, y, w, 12, placement_colour(p), "#555", tip)
    out.text(x + len(tiling) * w + 2, y + 10, label, 9, "#333", tip=tip)
    return len(tiling) * w + 8 + 6 * len(label)


def _ops(rows: list[Row]) -> str:
    """The ops of a box, by first appearance, counted: ``linear``, ``view x3, add``."""
    counts: dict[str, int] = {}
    for r in rows:
        if r.kind == "op":
            counts[short_op(r.op)] = counts.get(short_op(r.op), 0) + 1
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in counts.items()) or "-"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _box(out: _Svg, ex: Explanation, b: _Box, band: _Band, scale: float) -> None:
    g, choice = ex.graph, ex.choice
    comm = [c for r in b.rows for c in r.collectives]
    stroke = COMM if comm else "#777"
    memory = sum(r.memory for r in b.rows)
    out.rect(b.x, b.y, BOX_W, BOX_H, "#fbfbfb", stroke, rx=5,
             tip=f"{b.module}: {_ms(b.total_s)} (communication {_ms(b.comm_s)}), memory {fmt_memory(memory)}",
             extra=' stroke-width="1.5"' if comm else "")
    short = b.module[len(band.name) + 1:] if b.module.startswith(band.name + ".") else b.module
    out.text(b.x + 6, b.y + 15, _fit(short, BOX_W - 10, 11.5), 11.5, weight="bold", tip=b.module)
    out.text(b.x + 6, b.y + 29, _fit(_ops(b.rows), BOX_W - 10, 10), 10, "#555", tip=_ops(b.rows))
    # Chips: the parameters, then what the box returns.
    x, y = b.x + 6, b.y + 37
    params = [r for r in b.rows if r.kind in ("param", "buffer", "input")]
    for r in params[:4]:
        tiling = g.vars[r.index].strategies[choice[r.index]].outputs[0]
        last = r.label.rpartition(".")[2]
        label = {"weight": "W", "bias": "b"}.get(last, last[:6])
        x += _chip(out, x, y, tiling, label, f"{r.label}: {r.strategy}")
    if len(params) > 4:
        out.text(x, y + 10, f"+{len(params) - 4}", 9, "#333", tip=", ".join(f"{r.label}: {r.strategy}"
                                                                              for r in params[4:]))
    ops = [r for r in b.rows if r.kind in ("op", "reshard") and g.vars[r.index].strategies[choice[r.index]].outputs]
    if ops and b.module != INPUTS:
        last_op = ops[-1]
        tiling = g.vars[last_op.index].strategies[choice[last_op.index]].outputs[0]
        _chip(out, b.x + 6, y + 18, tiling, "out", f"{last_op.name} returns {','.join(map(str, tiling))}")
    # Collective badges, counted by kind; the tooltip lists every one.
    kinds: dict[str, int] = {}
    for c in comm:
        kinds[c.collective] = kinds.get(c.collective, 0) + 1
    if comm:
        tip = "\n".join(f"{c.phase} {c.step}" + (f" of {c.value}" if c.value else " inside the op")
                        + f": {c.bytes / 1e3:.2f} KB, {_ms(c.seconds)}" for c in comm)
        label = " ".join(f"{ABBREV.get(k, k)} {n}" for k, n in kinds.items())
        w = min(BOX_W - 12, 6.2 * len(label) + 8)
        out.rect(b.x + 6, b.y + 73, w, 14, "#fde0dd", COMM, tip, rx=3)
        out.text(b.x + 10, b.y + 84, _fit(label, w - 6, 10), 10, COMM, weight="bold", tip=tip)
    # Time bar: compute against communication, one scale for every box.
    comp_w, comm_w = (b.total_s - b.comm_s) * scale, b.comm_s * scale
    out.rect(b.x + 6, b.y + BOX_H - 11, comp_w, 6, COMPUTE, tip=f"compute {_ms(b.total_s - b.comm_s)}")
    out.rect(b.x + 6 + comp_w, b.y + BOX_H - 11, comm_w, 6, COMM, tip=f"communication {_ms(b.comm_s)}")


def _edges(ex: Explanation, where: dict[str, _Box]) -> dict[tuple[str, str], bool]:
    """Module-level dataflow: (source box, consumer box) -> does some edge between them run a collective.
    Parameters are drawn inside their box, not as edges."""
    g, choice = ex.graph, ex.choice
    module = {r.index: r.module for r in ex.rows}
    out: dict[tuple[str, str], bool] = {}
    for e in g.edges:
        if g.vars[e.src].kind in ("param", "buffer") or e.write_back:
            continue
        a, b = module[e.src], module[e.dst]
        if a == b or a not in where or b not in where:
            continue
        out[(a, b)] = out.get((a, b), False) or bool(e.bytes[choice[e.src], choice[e.dst]])
    return out


def _arrows(out: _Svg, edges: dict[tuple[str, str], bool], where: dict[str, _Box]) -> None:
    for (a, b), hot in edges.items():
        s, t = where[a], where[b]
        colour, width = (COMM, 1.6) if hot else ("#9a9a9a", 1.0)
        marker = "hot" if hot else "flow"
        if s.band == t.band:  # an arc above the band's boxes
            x1, x2, y = s.x + BOX_W / 2, t.x + BOX_W / 2, s.y
            h = min(ARC_H - 4, 10 + 5 * abs(t.col - s.col))
            path = f"M {x1:.1f} {y:.1f} C {x1:.1f} {y - h:.1f}, {x2:.1f} {y - h:.1f}, {x2:.1f} {y:.1f}"
        elif t.band == s.band + 1:  # into the next band
            x1, y1, x2, y2 = s.x + BOX_W / 2, s.y + BOX_H, t.x + BOX_W / 2, t.y
            path = f"M {x1:.1f} {y1:.1f} C {x1:.1f} {y1 + 30:.1f}, {x2:.1f} {y2 - 30:.1f}, {x2:.1f} {y2:.1f}"
        else:
            continue  # edges that skip bands would cross the picture: the badges still count their collectives
        out.add(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="{width}" '
                f'marker-end="url(#{marker})"><title>{escape(a)} -> {escape(b)}</title></path>')


def _legend(out: _Svg, ex: Explanation) -> None:
    p = ex.plan
    out.text(16, 26, f"soybean plan: {p.devices} devices, mesh {'x'.join(map(str, p.mesh))}, objective "
                     f"{p.objective}, profile {p.profile}; step {_ms(ex.step_time_s)}", 16, weight="bold")
    x = 16.0
    out.text(x, 52, "tensor tiling (one stripe per mesh axis, axis 0 first):", 11)
    x += 300
    for label, colour in [("R", REPLICATE), *((f"S({d})", SHARD[d]) for d in range(4)), ("P", PARTIAL)]:
        out.rect(x, 42, 12, 12, colour, "#555")
        out.text(x + 16, 52, label, 11)
        x += 52
    out.text(16, 74, "collectives per box (red badge, tooltip lists each): AG all_gather, RS reduce_scatter, "
                     "AR all_reduce, A2A all_to_all, halo exchange; red lines: dataflow that runs a collective", 11)
    out.rect(16, 86, 12, 8, COMPUTE)
    out.text(32, 94, "compute", 11)
    out.rect(96, 86, 12, 8, COMM)
    out.text(112, 94, "communication (bars: box and row time per training step, one scale)", 11)
    out.text(16, 118, "W weight, b bias, out: the tiling the module returns", 11, "#555")


def _step_bar(out: _Svg, ex: Explanation, y: float, width: float) -> None:
    """The per-device step: compute | blocking communication | gradient sync, the hidden part marked."""
    r = ex.result
    total = max(ex.total_s, 1e-30)
    scale = width / total
    x0 = LABEL_W
    out.text(16, y + 14, "every device", 12, weight="bold",
             tip=f"SPMD: each of the {ex.plan.devices} ranks runs the same program")
    blocking = r.comm_s - r.sync_s
    segs = [("compute", r.compute_s, COMPUTE), ("communication", blocking, COMM), ("gradient sync", r.sync_s, SYNC)]
    x = float(x0)
    for name, s, colour in segs:
        out.rect(x, y, s * scale, 20, colour, tip=f"{name} {_ms(s)} ({s / total:.1%})")
        x += s * scale
    if r.hidden_s:
        out.rect(x0 + (total - r.hidden_s) * scale, y + 22, r.hidden_s * scale, 6, HIDDEN,
                 tip=f"gradient sync hidden behind backward: {_ms(r.hidden_s)}")
    step_x = x0 + ex.step_time_s * scale
    out.add(f'<line x1="{step_x:.1f}" y1="{y - 6:.1f}" x2="{step_x:.1f}" y2="{y + 32:.1f}" stroke="#000" '
            'stroke-width="1.5" stroke-dasharray="3,2"/>')
    out.text(x0, y + 46, f"compute {_ms(r.compute_s)} + communication {_ms(blocking)} + gradient sync "
                         f"{_ms(r.sync_s)} - hidden behind backward {_ms(r.hidden_s)} = step {_ms(ex.step_time_s)} "
                         f"(dashed)", 11)


def svg(ex: Explanation) -> str:
    """The plan as an SVG document (module docstring)."""
    bands = layout(ex)
    where = {b.module: b for band in bands for b in band.boxes}
    widest = max((len(band.boxes) for band in bands), default=1)
    bars_x = LABEL_W + widest * (BOX_W + GAP) + 10
    width = bars_x + BAR_W + 80
    step_y = (bands[-1].y + ARC_H + BOX_H + BAND_GAP + 20) if bands else 160.0
    height = step_y + 70
    out = _Svg()
    out.add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" style="{FONT};background:#fff">')
    heads = (("flow", "#9a9a9a"), ("hot", COMM))
    out.add("<defs>" + "".join(
        f'<marker id="{n}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" markerHeight="6" orient="auto">'
        f'<path d="M0,0 L8,4 L0,8 z" fill="{c}"/></marker>' for n, c in heads) + "</defs>")
    out.rect(0, 0, width, height, "#ffffff")
    _legend(out, ex)
    box_max = max((b.total_s for b in where.values()), default=0.0) or 1.0
    band_max = max((band.total_s for band in bands), default=0.0) or 1.0
    _arrows(out, _edges(ex, where), where)
    for band in bands:
        out.text(12, band.y + ARC_H + BOX_H / 2 + 4, _fit(band.name, LABEL_W - 16, 12.5, keep_end=True), 12.5,
                 weight="bold", tip=band.name)
        for b in band.boxes:
            _box(out, ex, b, band, (BOX_W - 12) / box_max)
        y = band.y + ARC_H + BOX_H / 2 - 6
        comm_w, all_w = band.comm_s / band_max * BAR_W, band.total_s / band_max * BAR_W
        out.rect(bars_x, y, all_w - comm_w, 12, COMPUTE, tip=f"{band.name} compute {_ms(band.total_s - band.comm_s)}")
        out.rect(bars_x + all_w - comm_w, y, comm_w, 12, COMM, tip=f"{band.name} communication {_ms(band.comm_s)}")
        out.text(bars_x, y + 26, f"{_ms(band.total_s)} ({band.comm_s / band.total_s:.0%} comm)"
                 if band.total_s else "0 ms", 10, "#333")
    _step_bar(out, ex, step_y, max(300.0, bars_x + BAR_W - LABEL_W))
    out.add("</svg>")
    return "\n".join(out.parts) + "\n"


def page(ex: Explanation) -> str:
    """An HTML page: the picture, and ``soybean explain``'s text folded under it."""
    p = ex.plan
    title = f"soybean plan: {p.devices} devices, mesh {'x'.join(map(str, p.mesh))}"
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) + "</title>"
            "<style>body{font-family:Helvetica,Arial,sans-serif;margin:16px} pre{font-size:12px}</style>"
            "</head><body>\n" + svg(ex) + "<details><summary>Why each tiling (soybean explain)</summary><pre>"
            + html.escape(format_text(ex)) + "</pre></details>\n</body></html>\n")


# A placed plan's device groups: each group's regions headed in its colour (every device's regions in grey).
GROUP_COLOURS = ("#cfe3f7", "#f9dcc4", "#d4edda", "#eadcf8", "#fbeaa5", "#f6d0d8", "#d0f0ef", "#e2e2c8")
ALL_DEVICES = "#eef2f7"


def group_colours(ranks: Sequence[Sequence[int]], devices: int) -> list[str]:
    """The band colour of each region of a placed plan by its ranks: one colour per distinct group, grey for the
    regions on every device."""
    seen: dict[tuple[int, ...], str] = {}
    out = []
    for rk in ranks:
        key = tuple(rk)
        if len(key) == devices:
            out.append(ALL_DEVICES)
            continue
        out.append(seen.setdefault(key, GROUP_COLOURS[len(seen) % len(GROUP_COLOURS)]))
    return out


def stacked(parts: Sequence[tuple[str, Explanation]], html_page: bool = False, kind: str = "pipeline stage",
            colours: Sequence[str] | None = None) -> str:
    """A pipelined or placed plan: each stage's (``kind``: or region's) picture (``svg``) in a band of its own,
    one under the other in order, headed by its row of the plan's table (``title``: lines of text) and framed in
    its ``colours`` entry (a placed plan's device group, ``group_colours``); ``html_page``: an HTML page with each
    one's ``soybean explain`` text folded under its picture."""
    if html_page:
        body = "".join(f"<h3 style=\"background:{colours[k] if colours else ALL_DEVICES}\">{kind.capitalize()} {k}"
                       f"</h3><pre>{html.escape(title)}</pre>" + svg(ex)
                       + "<details><summary>Why each tiling (soybean explain)</summary><pre>"
                       + html.escape(format_text(ex)) + "</pre></details>\n" for k, (title, ex) in enumerate(parts))
        return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>soybean pipelined plan</title>"
                "<style>body{font-family:Helvetica,Arial,sans-serif;margin:16px} pre{font-size:12px}</style>"
                "</head><body>\n" + body + "</body></html>\n")
    pics, y, width = [], 0.0, 0.0
    for k, (title, ex) in enumerate(parts):
        lines = title.splitlines()
        head = 22.0 + 15.0 * len(lines)
        pic = svg(ex)
        w, h = (float(x) for x in re.findall(r'width="([\d.]+)" height="([\d.]+)"', pic)[0])
        out = _Svg()
        out.rect(0, y, max(w, 900.0), head, colours[k] if colours else ALL_DEVICES)
        out.text(12, y + 17, f"{kind} {k}", 13, weight="bold")
        for i, line in enumerate(lines):
            out.add(f'<text x="12" y="{y + 34 + 15 * i:.0f}" font-family="monospace" font-size="11" '
                    f'fill="#222" xml:space="preserve">{html.escape(line)}</text>')
        frame = ""
        if colours:  # every box of the region inside its device group's colour
            border = _Svg()
            border.rect(2, y + 2, max(w, 900.0) - 4, head + h - 4, "none", colours[k], extra=' stroke-width="4"')
            frame = "".join(border.parts)
        pics.append("".join(out.parts) + pic.replace("<svg ", f'<svg x="0" y="{y + head:.0f}" ', 1) + frame)
        y += head + h + 12
        width = max(width, w, 900.0)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}" '
            f'viewBox="0 0 {width:.0f} {y:.0f}" style="{FONT};background:#fff">' + "".join(pics) + "</svg>\n")


__all__ = ["band_of", "group_colours", "layout", "page", "placement_colour", "stacked", "svg"]
