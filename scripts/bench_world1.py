"""soybean's generated program at world size 1 against the plain eager model.

    python scripts/bench_world1.py [MODEL] [--arg key=value ...] [--steps 30] [--threads 1]

Both train in this process with the same thread count, taking turns step by step (forward,
backward, AdamW step, zero_grad); it prints the median time of each phase and the ratio
soybean / eager of the whole step (1.00 = as fast; the overhead of the generated program).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soybean  # noqa: E402
from soybean import models  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="examples.models:mlp")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    args = models.parse_args(a.arg) or {"hidden": 512, "batch": 1024, "layers": 2}
    variants = {}
    for name in ("eager", "soybean"):
        torch.manual_seed(0)
        model, inputs = models.load(a.model, args)
        if name == "soybean":
            model = soybean.parallelize(model, inputs, devices=1)
        variants[name] = (model, inputs, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in variants}
    for i in range(a.warmup + a.steps):
        for name, (model, inputs, opt) in variants.items():
            t0 = time.perf_counter()
            out = model(*inputs)
            loss = out if out.dim() == 0 else out.sum()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if i >= a.warmup:
                times[name].append((t1 - t0, t2 - t1, t3 - t2))
    med = {n: [statistics.median(x[k] for x in ts) * 1e3 for k in range(3)] + [statistics.median(sum(x) for x in ts) * 1e3]
           for n, ts in times.items()}
    print(f"{a.model} {' '.join(f'{k}={v}' for k, v in args.items())} | {a.threads} thread(s) | median of {a.steps} steps, taking turns")
    print(f"{'':<8} {'forward':>9} {'backward':>9} {'AdamW':>9} {'step ms':>9}")
    for n, (f, b, o, s) in med.items():
        print(f"{n:<8} {f:9.2f} {b:9.2f} {o:9.2f} {s:9.2f}")
    print(f"soybean / eager: {med['soybean'][3] / med['eager'][3]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
