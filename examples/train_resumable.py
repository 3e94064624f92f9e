"""A training loop that survives a lost rank: checkpoint (model, optimizer, step) every few steps, resume from the
newest checkpoint at start.

    soybean run --nproc 2 examples/train_resumable.py --dir /tmp/ckpt                 # train, checkpointing
    torchrun --nproc-per-node 2 --max-restarts 1 examples/train_resumable.py --dir /tmp/ckpt \\
        --kill-rank 1 --kill-step 5          # rank 1 dies at step 5; torchrun restarts both ranks, which resume

What makes the resumed run the run it replaces, loss for loss:
- the checkpoint holds every tile of the model, the optimizer's state for each tile (AdamW's moments and step)
  and the loop's own state (``extra``: the step; a scheduler's ``state_dict()`` and RNG states go there too);
- the data of step ``s`` is a function of ``s`` alone (here a generator seeded with ``s``; with a DataLoader,
  a sampler seeded per epoch and skipping the batches already seen), so the resumed steps see the same batches;
- a checkpoint is taken after a step completes, and a save interrupted by the failure is never loaded: the
  newest *committed* checkpoint is.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soybean


def batch(step: int, size: int, features: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: the same on every rank and in every attempt."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, features, generator=g), torch.randint(0, classes, (size,), generator=g)


def make_model(hidden: int, features: int = 32, classes: int = 10) -> nn.Module:
    """The model every attempt starts from (its initial weights seeded; a resumed run overwrites them)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, classes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="checkpoint directory (created; resumed from when it has one)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2, help="checkpoint after every this many steps")
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept (the newest)")
    ap.add_argument("--hidden", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--objective", default="time", choices=["time", "comm"],
                    help="comm: SoyBean's bytes objective, which splits the weights (and their moments) here")
    ap.add_argument("--kill-rank", type=int, default=None, help="this rank SIGKILLs itself (first attempt only)")
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--losses", default=None, help="rank 0 appends 'attempt step loss' lines to this file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    features, classes = 32, 10
    model = make_model(a.hidden, features, classes)
    x, _ = batch(0, a.batch, features, classes)
    pmodel = soybean.parallelize(model, (x,), objective=a.objective)  # world size and rank: from the launcher
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = 0
    if soybean.latest_checkpoint(a.dir) is not None:
        extra = pmodel.load_sharded(a.dir, optimizer=opt)
        start = extra["step"] + 1
        if rank == 0:
            print(f"resumed from {soybean.latest_checkpoint(a.dir)} at step {start}", flush=True)
    for step in range(start, a.steps):
        if rank == a.kill_rank and step == a.kill_step and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost node: no cleanup, no message
        x, y = batch(step, a.batch, features, classes)
        loss = F.cross_entropy(pmodel(x), y)  # the loss outside the model
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.9g}", flush=True)
            if a.losses:
                with open(a.losses, "a") as f:
                    f.write(f"{attempt} {step} {loss.item()!r}\n")
        if (step + 1) % a.every == 0:
            pmodel.save_sharded(a.dir, optimizer=opt, extra={"step": step}, keep=a.keep)


if __name__ == "__main__":
    main()
