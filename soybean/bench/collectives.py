"""Collective benchmark: every collective x algorithm x size on the current backend, predicted against measured.

    python scripts/bench_collectives.py --devices 4 [--profile NAME_OR_JSON] [--sizes 4K,64K,1M,4M,16M,64M]
                                        [--reps 10] [--json]

On ``--devices`` processes of the current backend (gloo on CPU, NCCL on GPUs) it times broadcast, reduce,
all-reduce, all-gather and reduce-scatter, each run by every algorithm of ``runtime.algorithms`` (the
backend's own, and soybean's ``lp``, ``ring`` and ``tree``), for each message size (the kinds table's
message: the buffer; the full result of an all-gather; the full input of a reduce-scatter), every call as
``soybean calibrate`` times it (the median of ``--reps`` runs on rank 0, each started right after a barrier;
``lp`` with the chunk count the planner would use).  Beside each it prints the profile's prediction
(``rounds alpha + bytes beta`` with the algorithm's own figures, ``ir.algorithms.terms``) and marks the
algorithm the planner picks for that collective and size (``cost.collectives.choose``) and the one measured
fastest.  ``--json`` prints ``{"rows": [{"collective", "algorithm", "bytes", "group_size", "measured_s",
"predicted_s", "chosen", "chunks"}], ...}``; ``chosen`` is true on the planner's pick.

``--modelled 8,64,1024 [--inter-node] --profile h100-nvlink-ib`` runs nothing: it prints the planner's pick and
modelled time for each collective, group size and message, for machines not at hand.

With ``--profile calibrate`` the profile is measured first (``soybean calibrate``, same processes count), so
the predictions are the calibrated ones.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..cost.collectives import choose
from ..cost.profiles import Profile, load_profile
from ..runtime import algorithms as A
from ..runtime.comm import TorchGroup
from ..runtime.launch import spawn
from .calibrate import algorithm_call, calibrate, fastest_medians, message_bytes

__all__ = ["run", "main", "modelled", "parse_size", "rows_table", "summary"]

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"`` -> 67108864, ``"123"`` -> 123."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _worker(rank: int, world: int, sizes: list[int], reps: int, profile: Profile) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    group = TorchGroup(dist.group.WORLD)
    out = []
    for collective in A.COLLECTIVES:
        for size in sizes:
            m = message_bytes(size, world)
            calls, chunks = [], []
            for algorithm in A.ALGORITHMS:
                k = 1
                if algorithm == "lp":
                    k = int(A.lp_chunks(collective, m, world, *profile.ab(0, collective, "lp", m)))
                calls.append(algorithm_call(group, collective, algorithm, size, world, device, k)[0])
                chunks.append(k)
            # The algorithms take turns, three rounds, the fastest median of each: drift and outside load, which
            # only ever add time, favour none of them.
            times = fastest_medians(calls, reps if size < (8 << 20) else max(2, reps // 2))
            pick = choose(collective, m, world, 0, profile).algorithm
            for algorithm, t, k in zip(A.ALGORITHMS, times, chunks):
                a, b = profile.ab(0, collective, algorithm, m)
                rounds, sent = A.terms(collective, algorithm, m, world, k)
                out.append({"collective": collective, "algorithm": algorithm, "bytes": m, "group_size": world,
                            "measured_s": t, "predicted_s": float(rounds * a + sent * b), "chunks": k,
                            "chosen": pick == algorithm})
            if rank == 0:
                print(f"\r{collective:<15} {size / 2**20:9.3f} MB", end="", file=sys.stderr, flush=True)
    if rank == 0:
        print(file=sys.stderr)
    return out


def run(devices: int, sizes: list[int], reps: int, profile: Profile) -> list[dict[str, Any]]:
    """Every row (module docstring), measured on ``devices`` fresh processes."""
    if devices < 2:
        raise ValueError("--devices must be >= 2: a collective on one device moves nothing")
    return spawn(_worker, devices, sizes, reps, profile, timeout_s=1800)[0]


def modelled(group_sizes: list[int], sizes: list[int], profile: Profile, inter_node: bool = False) -> str:
    """The planner's pick and its modelled time for every collective, group size and message (no run): the
    crossover table of a machine one cannot measure here.  ``inter_node``: the group crosses nodes (the
    profile's ``node_alpha``, ``node_beta``)."""
    prof = replace(profile, inter_node=(True,)) if inter_node else profile
    lines = [f"{'collective':<15}{'devices':>8}  " + "  ".join(f"{_fmt_bytes(m):>14}" for m in sizes)]
    for collective in A.COLLECTIVES:
        for p in group_sizes:
            cells = []
            for m in sizes:
                c = choose(collective, float(m), p, 0, prof)
                cells.append(f"{c.algorithm}{'/' + str(c.chunks) if c.algorithm == 'lp' else ''} "
                             f"{_fmt_s(c.seconds)}")
            lines.append(f"{collective:<15}{p:>8}  " + "  ".join(f"{x:>14}" for x in cells))
    return "\n".join(lines)


def _fmt_s(s: float) -> str:
    return f"{s * 1e6:.0f}us" if s < 1e-3 else f"{s * 1e3:.1f}ms"


def rows_table(rows: list[dict[str, Any]]) -> str:
    """One line per (collective, size): each algorithm's measured and predicted ms, the planner's pick (*) and
    the fastest measured (+), and the pick's time over the fastest's."""
    lines = [f"{'collective':<15}{'bytes':>10}  " + "  ".join(f"{a:>17}" for a in A.ALGORITHMS)
             + "   pick/fastest", " " * 27 + "  ".join(f"{'meas/pred ms':>17}" for _ in A.ALGORITHMS)]
    keys = list(dict.fromkeys((r["collective"], r["bytes"]) for r in rows))
    for c, m in keys:
        mine = {r["algorithm"]: r for r in rows if (r["collective"], r["bytes"]) == (c, m)}
        fastest = min(mine.values(), key=lambda r: r["measured_s"])
        pick = next(r for r in mine.values() if r["chosen"])
        cells = []
        for a in A.ALGORITHMS:
            r = mine[a]
            mark = ("*" if r["chosen"] else " ") + ("+" if r is fastest else " ")
            cells.append(f"{r['measured_s'] * 1e3:7.2f}/{r['predicted_s'] * 1e3:7.2f}{mark}")
        lines.append(f"{c:<15}{_fmt_bytes(m):>10}  " + "  ".join(f"{x:>17}" for x in cells)
                     + f"   {pick['measured_s'] / fastest['measured_s']:.2f}")
    return "\n".join(lines)


def _fmt_bytes(m: float) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if m >= size:
            return f"{m / size:g}{unit}"
    return f"{m:g}"


def summary(rows: list[dict[str, Any]], min_bytes: int = 4 << 20) -> dict[str, float]:
    """Over the (collective, size) pairs of at least ``min_bytes``: the worst pick-over-fastest ratio, and the
    median and worst |predicted - measured| / measured over every row of at least ``min_bytes``."""
    big = [r for r in rows if r["bytes"] >= min_bytes]
    ratios = []
    for c, m in dict.fromkeys((r["collective"], r["bytes"]) for r in big):
        mine = [r for r in big if (r["collective"], r["bytes"]) == (c, m)]
        ratios.append(next(r for r in mine if r["chosen"])["measured_s"] / min(r["measured_s"] for r in mine))
    errors = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in big]
    return {"worst_pick_over_fastest": max(ratios, default=1.0),
            "median_prediction_error": float(np.median(errors)) if errors else 0.0,
            "worst_prediction_error": max(errors, default=0.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_collectives", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--profile", default=None, help="built-in name, calibrate JSON, or 'calibrate' (measure first)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated message sizes (default {DEFAULT_SIZES})")
    ap.add_argument("--reps", type=int, default=10,
                    help="timed calls per algorithm per round (half from 8 MB up): ten, as calibrate times")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--modelled", metavar="P1,P2,...", default=None,
                    help="run nothing: print the planner's pick and modelled time per collective for these group sizes")
    ap.add_argument("--inter-node", action="store_true", help="with --modelled: the groups cross nodes")
    args = ap.parse_args(argv)
    if args.modelled:
        prof = load_profile(args.profile or "h100-nvlink")
        print(f"modelled, profile {prof.name}{' across nodes' if args.inter_node else ''}: the planner's pick "
              "(lp/k: k chunks) and its time")
        print(modelled([int(p) for p in args.modelled.split(",")], [parse_size(s) for s in args.sizes.split(",")],
                       prof, args.inter_node))
        return 0
    if args.profile == "calibrate":
        profile, _ = calibrate(args.devices, show=not args.json)
    else:
        profile = load_profile(args.profile)
    rows = run(args.devices, [parse_size(s) for s in args.sizes.split(",")], args.reps, profile)
    info = {"devices": args.devices, "backend": "nccl" if torch.cuda.is_available() else "gloo",
            "profile": profile.name, "summary_4mb_and_up": summary(rows)}
    if args.json:
        print(json.dumps({"rows": rows, **info}, indent=1))
    else:
        print(f"{args.devices} processes, {info['backend']}, profile {profile.name}; measured/predicted ms, "
              "* the planner's pick, + the fastest measured")
        print(rows_table(rows))
        s = info["summary_4mb_and_up"]
        print(f"messages >= 4 MB: the pick is at worst {s['worst_pick_over_fastest']:.3f}x the fastest; "
              f"prediction error median {s['median_prediction_error']:.0%}, worst {s['worst_prediction_error']:.0%}")
    return 0
