"""Train the example MLP with soybean on N local gloo processes; print each step's loss beside serial.

    python examples/train_mlp.py --nproc 2            # local CPU default
    torchrun --nproc-per-node 2 examples/train_mlp.py # the same under torchrun
    # two nodes (here both on localhost), one process each:
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        examples/train_mlp.py --gpus-per-node 1
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soybean  # noqa: E402
from examples.models import mlp  # noqa: E402

STEPS = 5


def fit(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = STEPS) -> list[float]:
    """The user's unchanged training loop: AdamW, loss.backward(), step, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def serial_losses(kw: dict) -> list[float]:
    model, (x, y) = mlp(**kw)
    return fit(model, x, y)


def train(rank: int, world: int, kw: dict, gpus_per_node: int | None = None) -> list[float]:
    torch.set_num_threads(1)
    model, (x, y) = mlp(**kw)
    pmodel = soybean.parallelize(model, (x, y), devices=world, objective="time", gpus_per_node=gpus_per_node)
    losses = fit(pmodel, x, y)
    if rank == 0:
        print(f"plan: mesh {pmodel.plan.mesh}, params {pmodel.plan.params}")
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="devices per node: mesh axes crossing nodes are priced at the inter-node link")
    a = ap.parse_args()
    kw = dict(batch=a.batch, hidden=a.hidden, layers=2)
    if "RANK" in os.environ:  # under torchrun
        from soybean.runtime.launch import init_from_env

        rank, world = init_from_env()
        losses = [train(rank, world, kw, a.gpus_per_node)]
    else:
        from soybean.runtime.launch import spawn

        losses = spawn(train, a.nproc, kw, a.gpus_per_node, timeout_s=300)
    if "RANK" not in os.environ or int(os.environ["RANK"]) == 0:
        ref = serial_losses(kw)
        print(f"{'step':>4}  {'soybean':>12}  {'serial':>12}")
        for i, (p, s) in enumerate(zip(losses[0], ref)):
            print(f"{i:>4}  {p:12.6f}  {s:12.6f}")
        worst = max(abs(p - s) / max(abs(s), 1e-12) for p, s in zip(losses[0], ref))
        print(f"max relative difference: {worst:.2e}")


if __name__ == "__main__":
    main()
