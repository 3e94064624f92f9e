"""The main job: a small GPT-style transformer trained on N local gloo processes with the plan soybean picks.

    python examples/train_transformer.py                 # 2 processes on this machine's CPUs (gloo)
    python examples/train_transformer.py --nproc 4 --hidden 1024 --batch 4

It prints, in order:

* the plan: per module, its weight's tiling and the tilings in and out (per mesh axis: ``S(d)`` split along dim
  ``d``, ``R`` whole on every rank, ``P`` a pending sum) and the collectives placed where tilings change; at this
  size it is Megatron's layout (q/k/v and fc1 split by output, o and fc2 by input), found by the search;
* the modelled step of that plan and of data parallelism (DDP), from the built-in ``cpu-gloo`` profile;
* the measured step of both on these processes, taking turns (DDP: ``torch.nn.parallel.DistributedDataParallel``
  on each rank's share of the batch);
* each step's loss beside the same model trained alone; the script fails if they differ beyond float32 rounding.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soybean
from examples.models import transformer
from soybean.report.table import table

STEPS = 5            # training steps whose losses are compared with serial
WARMUP, TIMED = 2, 10  # then rounds of one soybean step and one DDP step, the first WARMUP not timed
TOLERANCE = 1e-5     # float32: summing a split matmul in another order rounds differently


def fit(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step of the user's unchanged training loop: the model returns its loss."""
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def serial_losses(kw: dict) -> list[float]:
    model, (x, y) = transformer(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return [fit(model, opt, x, y) for _ in range(STEPS)]


def timed(step: Callable[[], object]) -> float:
    """Milliseconds of one step, every rank starting together."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def train(rank: int, world: int, kw: dict, plan_path: str) -> tuple[list[float], float, float]:
    """This rank's losses under soybean's plan, then the median step of soybean and of DDP, taking turns."""
    torch.set_num_threads(1)
    model, (x, y) = transformer(**kw)
    ddp_model = copy.deepcopy(model)  # the same initial weights
    pmodel = soybean.parallelize(model, (x, y), devices=world, plan=plan_path)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)  # this rank's tiles
    losses = [fit(pmodel, opt, x, y) for _ in range(STEPS)]

    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)  # DDP's contract: this rank's rows
    ours, theirs = [], []
    for i in range(WARMUP + TIMED):
        a = timed(lambda: fit(pmodel, opt, x, y))
        b = timed(lambda: fit(ddp, ddp_opt, x[rows], y[rows]))
        if i >= WARMUP:
            ours.append(a)
            theirs.append(b)
    return losses, statistics.median(ours), statistics.median(theirs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    if a.batch % a.nproc:
        ap.error(f"--batch {a.batch} does not split over --nproc {a.nproc} ranks (DDP needs it)")
    kw = dict(batch=a.batch, seq=a.seq, hidden=a.hidden, heads=a.heads, layers=a.layers)

    model, inputs = transformer(**kw)
    plan = soybean.plan(model, inputs, devices=a.nproc)  # no process group needed: a mesh is data
    print(table(plan))
    from soybean.runtime.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        plan.save(path)  # every rank runs exactly the plan printed above
        losses, ours, theirs = spawn(train, a.nproc, kw, path, timeout_s=300)[0]

    ddp = plan.baselines["data_parallel"]
    print(f"step (ms)   soybean  DDP      ({a.nproc} gloo processes, one thread each)")
    print(f"modelled    {plan.cost['step_time_s'] * 1e3:7.1f}  {ddp['step_time_s'] * 1e3:7.1f}  "
          f"(profile {plan.profile})")
    print(f"measured    {ours:7.1f}  {theirs:7.1f}  (median of {TIMED}, taking turns)")
    print()
    ref = serial_losses(kw)
    print(f"{'step':>4}  {'soybean':>12}  {'serial':>12}")
    for i, (p, s) in enumerate(zip(losses, ref)):
        print(f"{i:>4}  {p:12.6f}  {s:12.6f}")
    worst = max(abs(p - s) / max(abs(s), 1e-12) for p, s in zip(losses, ref))
    print(f"max relative difference: {worst:.2e} (float32; at most {TOLERANCE:g} passes)")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
