"""Train a model of parallel branches with its branches on their own processes (DLPlacer's placement), on N local
gloo processes, and print each step's loss beside serial training's.

    python examples/train_placed.py --nproc 2                        # 2 towers, one per process
    python examples/train_placed.py --nproc 4 --model inception      # Inception blocks: 4 branches each
    soybean plan examples.models:towers --devices 2 --placement auto  # the plan: regions, ranks, modelled step

The training loop is the plain one: ``loss = loss_fn(pmodel(x), y)``, ``loss.backward()`` on every rank, the
optimizer on this rank's regions' parameters.  ``placement="auto"`` keeps the plan without placement where that is
modelled faster (then the module is an ordinary ``ParallelModule``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soybean
from examples.models import inception, towers

STEPS = 4
MODELS = {"towers": (towers, {"batch": 8, "width": 64, "layers": 4}),
          "inception": (inception, {"batch": 4, "image": 8, "width": 0.25, "blocks": 2})}


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    factory, kw = MODELS[name]
    model, (x, y) = factory(**kw)
    return model.double(), x.double(), y


def serial_losses(name: str) -> list[float]:
    model, x, y = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def train(rank: int, world: int, name: str) -> list[float]:
    torch.set_num_threads(1)
    model, x, y = _model(name)
    pmodel = soybean.parallelize(model, (x,), devices=world, placement="auto")
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model.loss_fn(pmodel(x), y)  # the loss outside the model, on every rank
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    if rank == 0:
        place = pmodel.plan.placement
        print("regions:" if place else "no placement:",
              [(r["units"], r["ranks"], r["mesh"]) for r in place["regions"]] if place else pmodel.plan.mesh)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", choices=list(MODELS), default="towers")
    a = ap.parse_args()
    from soybean.runtime.launch import spawn

    got = spawn(train, a.nproc, a.model, timeout_s=600)
    ref = serial_losses(a.model)
    for step, (s, p) in enumerate(zip(ref, got[0])):
        print(f"step {step}: serial {s:.12f}  placed {p:.12f}")
    worst = max(abs(a - b) for losses in got for a, b in zip(losses, ref))
    print(f"largest difference from serial over {a.nproc} ranks: {worst:.3g}")
    if worst > 1e-9:
        sys.exit(1)


if __name__ == "__main__":
    main()
