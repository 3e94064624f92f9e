"""Train the example transformer as pipeline stages on N local gloo processes (one stage each), through
torch.distributed.pipelining, and print each step's loss beside serial training's.

    python examples/train_pipeline.py --nproc 2                       # 2 stages, 1F1B, 4 microbatches
    python examples/train_pipeline.py --nproc 2 --schedule gpipe --microbatches 2
    python examples/train_pipeline.py --nproc 2 --schedule zero-bubble --virtual-stages 2 --vocab 50
                                                    # 4 stages, the head tied to the token embedding
    soybean plan examples.models:transformer --arg batch=8 --arg layers=4 --devices 4 --pipeline 2   # the plan

The training loop calls ``pmodel.train_step(*inputs, loss_fn=fn)`` (forward and backward of the whole batch
through the schedule, the whole batch's loss returned on every rank) and steps the optimizer on this stage's
parameters.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soybean
from examples.models import transformer
from soybean.run.pipelined import SCHEDULES

STEPS = 4


def _model(kw: dict) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = transformer(**kw)  # with a vocabulary: token ids in, the head tied to the embedding
    return model.double(), tuple(x.double() if x.is_floating_point() else x for x in inputs)


def serial_losses(kw: dict) -> list[float]:
    model, inputs = _model(kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def train(rank: int, world: int, kw: dict, microbatches: int, schedule: str, virtual: int | None
          ) -> list[float]:
    torch.set_num_threads(1)
    model, inputs = _model(kw)
    pmodel = soybean.parallelize(model, inputs, devices=world, pipeline=world, microbatches=microbatches,
                                 schedule=schedule, virtual_stages=virtual)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.05)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = pmodel.train_step(*inputs, loss_fn=lambda o: o)  # the model returns its loss
        opt.step()
        out.append(float(loss))
    if rank == 0:
        pipe = pmodel.plan.pipeline or {}
        print("stages:", [(s["units"], s["ranks"]) for s in pipe.get("stages", [])],
              f"schedule {pipe.get('schedule')}, {pipe.get('microbatches')} microbatches")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=None,
                    help="stages per process (interleaved, zero-bubble; default 2 there, 1 with the others)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=None, help="a language model whose head is its token embedding")
    a = ap.parse_args()
    kw = dict(batch=8, seq=16, hidden=32, layers=a.layers, heads=4, vocab=a.vocab)
    from soybean.runtime.launch import spawn

    got = spawn(train, a.nproc, kw, a.microbatches, a.schedule, a.virtual_stages, timeout_s=300)
    ref = serial_losses(kw)
    for step, (s, p) in enumerate(zip(ref, got[0])):
        print(f"step {step}: serial {s:.12f}  pipelined {p:.12f}  diff {abs(s - p):.2e}")
    if any(abs(s - p) > 1e-9 * abs(s) for s, p in zip(ref, got[0])):
        raise SystemExit("the pipelined losses differ from serial training's")


if __name__ == "__main__":
    main()
