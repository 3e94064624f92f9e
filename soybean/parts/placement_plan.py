"""Branches on their own device groups (DLPlacer): which branches run where, chosen with every region's tiling.

The graph's series (``regions.segments``) run one after the other.  A serial segment runs on every device, tiled
by its own plan.  The branches of a parallel segment may instead be split into parts, each part placed on a
*group* of devices (contiguous ranks) that runs its branches one after the other, tiled by a plan of the part on
the group's devices, while the other groups run theirs at the same time.  What a part returns (read by the next
serial segment, on every device) moves to the devices outside its group by point-to-point messages
(``part.crossing_s`` on the ``"p2p"`` link: ``ir.transfers``' pairs, priced as ``runtime.transfer`` sends them; no
gradient comes back, since every device of the group computes it whole in the next segment).

A trained weight several regions read (two branches sharing a layer, an embedding tied to the head across a placed
segment) is a copy in each, as a weight two pipeline stages read: its copies' gradients are summed once per step
(``part.shared_params``, ``checkpoint_view.PartsModule._sum_tied_grads``), over the union of its regions' ranks
when they differ (``part.tie_s``; on each rank, for nothing, when every reader is on the same ranks).  A placed
option pays the sums it makes (``segment_options``' ``ties``); a weight two placeable segments read is priced in
each placed option of either (an upper bound when both are placed), so such a plan's choice is the best segment by
segment, not proven (``gap`` None), while its step counts each sum once.

The step's makespan is the sum over segments of each one's time: a serial segment's step (its plan's
``step_time_s``, forward, backward, gradient sync and optimizer on its devices); a parallel segment's
``max`` over its groups of (the sum of the part's branches' steps on ``d`` devices, each branch planned alone by
``planner.plan`` on ``d`` devices, plus the part's sends).  Taking each group's forward and backward together
is exact when the groups' backward-to-forward ratios agree (a forward barrier at the join and a backward one at
the fork give ``max F + max B``; ``max (F + B)`` equals it then, and is its lower bound otherwise).

For one segment with ``k`` branches, every set partition of the branches (Bell(k)) and every composition of the
devices into as many group sizes (``group_sizes``: any up to 8 devices, powers of two and divisors beyond) is priced
(``segment_options``): the minimum is exact, and a segment of more than ``MAX_BRANCHES`` branches is left serial.
Segments are independent given that serial segments hand whole values to the next (and that no weight is shared
between two that may be placed), so the placed plan is the per-segment minimum; the parts then planned together (a
group's branches as one capture, consecutive serial segments as one) are priced again for the record, and
``api.placed_or_plain`` keeps the cheaper of that and the plan without placement.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..capture.core import Captured
from ..cost.profiles import Profile, load_profile
from ..graph.units import node_module
from ..options import PlanOptions
from ..plan import Plan
from .part import Facts, Part, crossing_s, grad_bytes, shared_params, tie_s, value_facts
from .regions import Region, Segment, params_read, segments, shape_key, split

MAX_BRANCHES = 8  # Bell(8) = 4,140 partitions of a segment's branches
SMALL_WORLD = 8  # up to this many devices, groups of any size


@dataclass(frozen=True)
class Option:
    """One way to run a parallel segment: its parts (branch indices), each on a group of ``sizes[i]`` devices."""

    parts: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    seconds: float

    @property
    def placed(self) -> bool:
        return len(self.parts) > 1


def set_partitions(items: Sequence[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty parts (each part in ``items``' order, parts by first item)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in set_partitions(rest):
        yield [[first], *p]
        for i in range(len(p)):
            yield [*p[:i], [first, *p[i]], *p[i + 1:]]


def group_sizes(devices: int) -> list[int]:
    """The sizes a group may have: any up to ``SMALL_WORLD`` devices, else the powers of two and the divisors of
    ``devices`` (a 64-device mesh splits 32 + 16 + 16, not 37 + 27)."""
    if devices <= SMALL_WORLD:
        return list(range(1, devices + 1))
    return sorted({d for d in range(1, devices + 1) if devices % d == 0} | {1 << k for k in range(devices.bit_length())
                                                                            if 1 << k <= devices})


def compositions(total: int, parts: int, sizes: Sequence[int] | None = None) -> Iterator[tuple[int, ...]]:
    """Every ordered way to write ``total`` as ``parts`` positive sizes (of ``sizes`` when given)."""
    allowed = list(sizes) if sizes is not None else list(range(1, total + 1))
    if parts == 1:
        if total in allowed:
            yield (total,)
        return
    for first in allowed:
        if first < total:
            for rest in compositions(total - first, parts - 1, allowed):
                yield (first, *rest)


def group_sends_s(facts: Facts, names: Sequence[str], group: int, devices: int, profile: Profile) -> float:
    """Seconds the values ``names`` a group of ``group`` devices (the first ranks) made take to reach a region on
    every one of ``devices`` devices (a placed segment's next serial region): ``part.crossing_s`` on soybean's own
    point-to-point link, nothing coming back (that region's gradient is on every device of the group already)."""
    return crossing_s(facts, names, range(group), range(devices), profile, "p2p")


def segment_options(steps: Callable[[int, int], float], sends: Callable[[Sequence[int], int], float],
                    branches: int, devices: int,
                    ties: Callable[[Sequence[Sequence[int]], Sequence[int]], float] | None = None) -> list[Option]:
    """Every way to run a segment of ``branches`` branches on ``devices`` devices (module docstring), cheapest
    first; ``steps(b, d)``: branch ``b``'s step on ``d`` devices; ``sends(part, d)``: a part's sends from a group
    of ``d``; ``ties(parts, sizes)``: the gradient sums of the shared weights a placed option splits."""
    out: list[Option] = []
    for parts in set_partitions(list(range(branches))):
        if len(parts) > devices:
            continue
        for sizes in compositions(devices, len(parts), group_sizes(devices)):
            t = max(sum(steps(b, d) for b in part) + (sends(part, d) if len(parts) > 1 else 0.0)
                    for part, d in zip(parts, sizes))
            if ties is not None and len(parts) > 1:
                t += ties(parts, sizes)
            out.append(Option(tuple(tuple(p) for p in parts), sizes, t))
            if len(parts) == 1:
                break
    return sorted(out, key=lambda o: (o.seconds, len(o.parts)))


def module_prefixes(cap: Captured, nodes: Sequence[str]) -> list[str]:
    """What a region holds, for people: the innermost module holding all its ops, else its ops' top-level
    modules in graph order."""
    by_name = {n.name: n for n in cap.graph.nodes}
    paths = [p for n in nodes if (p := node_module(by_name[n]))]
    if not paths:
        return []
    parts = [p.split(".") for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    if common:
        return [".".join(common)]
    return list(dict.fromkeys(p[0] for p in parts))


def placeable(segs: Sequence[Segment], reads: Sequence[Sequence[set[str]]]) -> list[bool]:
    """Which segments may be placed: parallel, at most ``MAX_BRANCHES`` branches, each branch with weights to train
    (the work placement spreads; not the two halves of a broadcast).  ``reads``: each branch's trained weights
    (``regions.params_read``); a weight several read is summed across their groups (module docstring)."""
    return [s.parallel and len(s.branches) <= MAX_BRANCHES and all(reads[i]) for i, s in enumerate(segs)]


def segment_ties(reads: Sequence[Sequence[set[str]]], i: int, nbytes: dict[str, int], devices: int,
                 profile: Profile) -> Callable[[Sequence[Sequence[int]], Sequence[int]], float]:
    """``segment_options``' ``ties`` for segment ``i``: each weight its branches read that a placed option leaves in
    two or more regions (two of its parts, or one of them and another segment) summed over those regions' ranks
    (its parts' groups; every device when another segment reads it: at most that many), ``part.tie_s``."""
    mine = sorted(set().union(*reads[i]))
    outside = {w for j, rs in enumerate(reads) if j != i for r in rs for w in r}

    def ties(parts: Sequence[Sequence[int]], sizes: Sequence[int]) -> float:
        total = 0.0
        for w in mine:
            where = [d for part, d in zip(parts, sizes) if any(w in reads[i][b] for b in part)]
            if len(where) > 1 or w in outside:
                total += tie_s(nbytes[w], devices if w in outside else sum(where), profile)
        return total

    return ties


def plan_placement(cap: Captured, devices: int, options: PlanOptions,
                   say: Callable[[str], None] = lambda line: None, sizes: Sequence[int] | None = None,
                   cache_routes: bool = False) -> Plan | None:
    """The best placed plan of ``cap`` on ``devices`` devices (module docstring), or None when no segment may be
    placed (no parallel branches) or placing none is best.  ``sizes``: every placed segment on groups of these
    sizes (summing to ``devices``), its parts still chosen, whether or not that is modelled faster.
    ``cache_routes``: every plan starts from the route walks stored on disk (``planner.plan``'s), as
    ``soybean plan`` does."""
    if sizes is not None and sum(sizes) != devices:
        raise ValueError(f"groups of {list(sizes)} devices do not make {devices}: give sizes that sum to it")
    from ..planner.core import plan

    segs = segments(cap)
    reads = [[params_read(cap, b) for b in s.branches] for s in segs]
    ok = placeable(segs, reads)
    if devices < 2 or not any(ok):
        return None
    profile = options.profile if isinstance(options.profile, Profile) else load_profile(options.profile)
    facts = value_facts(cap)
    fine_pieces = [list(b) for s in segs for b in s.branches]
    fine = split(cap, fine_pieces)
    at: dict[tuple[int, int], Region] = {}
    k = 0
    for i, s in enumerate(segs):
        for j in range(len(s.branches)):
            at[(i, j)] = fine[k]
            k += 1
    cache: dict[tuple[str, int], Plan] = {}

    def planned(c: Captured, d: int) -> Plan:
        key = (shape_key(c), d)
        if key not in cache:
            # A region hands its outputs on whole (``run.placed``): priced as such, never left split for a lazy read.
            cache[key] = plan(None, (), d, options=options.merged(outputs="full"), baselines=False, captured=c,
                              cache_routes=cache_routes)
        return cache[key]

    chosen: list[Option | None] = []
    records: list[dict[str, Any]] = []
    for i, s in enumerate(segs):
        if not ok[i]:
            chosen.append(None)
            continue
        say(f"segment {i}: {len(s.branches)} branches")

        def steps(b: int, d: int, i: int = i) -> float:
            return float(planned(at[(i, b)].cap, d).cost["step_time_s"])

        def sends(part: Sequence[int], d: int, i: int = i) -> float:
            return group_sends_s(facts, [v for b in part for v in at[(i, b)].returns], d, devices, profile)

        opts = segment_options(steps, sends, len(s.branches), devices,
                               segment_ties(reads, i, grad_bytes(cap), devices, profile))
        forced = [o for o in opts if sizes is not None and o.sizes == tuple(sizes)]
        best = forced[0] if forced else opts[0]
        chosen.append(best if best.placed else None)
        records.append({"segment": i, "branches": len(s.branches), "placed": best.placed,
                        "parts": [list(p) for p in best.parts], "sizes": list(best.sizes), "step_s": best.seconds,
                        "unplaced_s": next(o.seconds for o in opts if not o.placed), "options": len(opts)})
    if not any(o is not None for o in chosen):
        return None
    # a weight two placeable segments read is priced in each placed option of either: the choice is not proven
    placeable_reads = [set().union(*rs) for rs, can in zip(reads, ok) if can]
    across = any(sum(w in r for r in placeable_reads) > 1 for w in set().union(*placeable_reads))
    return _placed(cap, segs, chosen, records, devices, profile, facts, planned, options, proven=not across)


def tied_weights(cap: Captured, regions: Sequence[Part], ranks: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """The trained weights two or more regions read (``part.shared_params``): each one's regions, the ranks its
    gradient sum runs over (the union of its regions' ranks; none when they are all on the same ranks, where each
    rank sums its own copies' gradients), and the bytes of its gradient (``part.grad_bytes``)."""
    nbytes = grad_bytes(cap)
    out = []
    for fqn, ks in shared_params(cap, [r.nodes for r in regions]).items():
        held = {tuple(ranks[k]) for k in ks}
        over = sorted({r for rk in held for r in rk}) if len(held) > 1 else []
        out.append({"param": fqn, "regions": ks, "ranks": over, "bytes": nbytes[fqn]})
    return out


def _placed(cap: Captured, segs: Sequence[Segment], chosen: Sequence[Option | None], records: list[dict[str, Any]],
            devices: int, profile: Profile, facts: Facts, planned: Callable[[Captured, int], Plan],
            options: PlanOptions, proven: bool) -> Plan:
    """The plan of the chosen options: the final regions planned, priced and recorded (``Plan.placement``);
    ``proven``: no weight is shared between two placeable segments, so the choice is the best of every way
    priced."""
    pieces, ranks, placed_in = region_pieces(segs, chosen, devices)
    regions = split(cap, region_nodes(cap, segs, pieces))
    rows: list[dict[str, Any]] = []
    for r, piece, rk, seg in zip(regions, pieces, ranks, placed_in):
        p = planned(r.cap, len(rk))
        send = group_sends_s(facts, r.returns, len(rk), devices, profile) if seg is not None else 0.0
        units = list(dict.fromkeys(u for s, b in piece for u in module_prefixes(cap, segs[s].branches[b])))
        rows.append({"units": units, "segment": seg, "pieces": [list(x) for x in piece],
                     "ranks": rk, "mesh": list(p.mesh), "step_s": float(p.cost["step_time_s"]), "transfer_s": send,
                     "sends": list(r.returns), "send_bytes": sum(facts[v][0] for v in r.returns),
                     "plan": p.to_dict()})
    # serial regions one after the other; the groups of a placed segment at the same time
    step = sum(row["step_s"] for row in rows if row["segment"] is None)
    for seg in {row["segment"] for row in rows if row["segment"] is not None}:
        step += max(row["step_s"] + row["transfer_s"] for row in rows if row["segment"] == seg)
    ties = tied_weights(cap, regions, ranks)
    step += sum(tie_s(t["bytes"], len(t["ranks"]), profile) for t in ties if t["ranks"])
    # every way of every segment was priced: the choice is optimal for the model above (gap 0) when ``proven``;
    # each region's own tiling carries its solver's gap in its plan
    gap = max(float(row["plan"]["solver"].get("gap", 0.0)) for row in rows)
    record = {"regions": rows, "segments": records,
              "groups": max(sum(1 for row in rows if row["segment"] == i) for i in set(placed_in) if i is not None),
              "options": sum(r["options"] for r in records), "gap": 0.0 if proven else None, "region_gap": gap,
              **({"tied": ties} if ties else {})}
    first = Plan.from_dict(rows[0]["plan"])
    moe, cp = Plan.part_rows([Plan.from_dict(row["plan"]) for row in rows], "region")
    return Plan(devices=devices, mesh=[devices], objective=options.objective, profile=first.profile,
                fingerprint=cap.fingerprint, params={}, inputs={}, nodes={},
                cost={"step_time_s": step,
                      "compute_s": sum(float(r["plan"]["cost"].get("compute_s", 0.0)) for r in rows)},
                precision=cap.precision, placement=record, moe=moe, context_parallel=cp)


def region_pieces(segs: Sequence[Segment], chosen: Sequence[Option | None], devices: int
                  ) -> tuple[list[list[tuple[int, int]]], list[list[int]], list[int | None]]:
    """The regions of the chosen options, in order: each one's (segment, branch) pairs, its ranks, and the placed
    segment it is a part of (None: a serial region, on every device; consecutive serial segments are one)."""
    pieces: list[list[tuple[int, int]]] = []
    ranks: list[list[int]] = []
    placed_in: list[int | None] = []
    serial: list[tuple[int, int]] = []

    def flush() -> None:
        if serial:
            pieces.append(list(serial))
            ranks.append(list(range(devices)))
            placed_in.append(None)
            serial.clear()

    for i, (s, o) in enumerate(zip(segs, chosen)):
        if o is None:
            serial.extend((i, j) for j in range(len(s.branches)))
            continue
        flush()
        start = 0
        for part, d in zip(o.parts, o.sizes):
            pieces.append([(i, j) for j in part])
            ranks.append(list(range(start, start + d)))
            placed_in.append(i)
            start += d
    flush()
    return pieces, ranks, placed_in


def region_nodes(cap: Captured, segs: Sequence[Segment], pieces: Sequence[Sequence[Sequence[int]]]) -> list[list[str]]:
    """The node lists of regions given as (segment, branch) pairs (a plan's ``placement.regions[*].pieces``), each
    in graph order."""
    order = {n.name: i for i, n in enumerate(cap.graph.nodes)}
    return [sorted((n for s, b in piece for n in segs[s].branches[b]), key=order.__getitem__) for piece in pieces]
