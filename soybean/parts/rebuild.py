"""A plan in parts turned back into its parts: the one place a saved ``Plan.pipeline`` or ``Plan.placement`` is cut
again from a capture (``api.parallelize`` running a plan, ``soybean explain``/``draw`` explaining one, the tests).

A plan records how it cut the graph, not the cut parts: a pipelined plan each stage's layers, a placed plan each
region's (segment, branch) pieces of ``regions.segments``.  Both are cut again from the capture the plan was made
for (at the microbatch, for a pipelined plan), so every rank and every tool cuts the same parts, each with the plan
made for it.
"""
from __future__ import annotations

from dataclasses import replace

from ..capture.core import Captured
from ..plan import Plan
from .part import Part
from .placement_plan import region_nodes
from .regions import segments, split as split_regions
from .stages import split as split_stages


def parts_of(cap: Captured, plan: Plan) -> tuple[list[Part], list[Plan]]:
    """The parts ``plan`` records, cut from ``cap`` (the capture it was made for), and each part's own plan: a
    pipelined plan's ``stages.Stage``\\ s (their layers), a placed plan's ``regions.Region``\\ s (their pieces, and
    the placed segment each runs in at the same time as the others: None for a serial one)."""
    if plan.pipeline is not None:
        rows = plan.pipeline["stages"]
        parts: list[Part] = list(split_stages(cap, [(int(r["layers"][0]), int(r["layers"][1])) for r in rows]))
    elif plan.placement is not None:
        rows = plan.placement["regions"]
        cut = split_regions(cap, region_nodes(cap, segments(cap), [r["pieces"] for r in rows]))
        parts = [replace(reg, pieces=tuple((int(s), int(b)) for s, b in row["pieces"]), segment=row["segment"])
                 for reg, row in zip(cut, rows)]
    else:
        raise ValueError("the plan has neither pipeline stages nor placed regions: it runs as one program")
    return parts, [Plan.from_dict(r["plan"]) for r in rows]
