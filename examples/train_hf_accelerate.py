"""An Accelerate training loop (no Trainer) with soybean's plan: ``accelerator.prepare`` as usual, then one line.

    torchrun --nproc-per-node 2 examples/train_hf_accelerate.py            # soybean on 2 processes
    python examples/train_hf_accelerate.py --no-soybean                    # the same loop, plain, one process

The loop is Accelerate's own (``accumulate``, ``backward``, the optimizer's ``step`` and ``zero_grad``).  soybean
changes two lines: the prepared model is wrapped in ``soybean.hf.SoybeanModel`` (given the optimizer, which it
points at the tiles when it plans, at the first batch), and clipping is the model's ``clip_grad_norm_`` (the
serial norm over the tiles; ``accelerator.clip_grad_norm_`` would see one rank's tiles only).  ``--batch`` is the
global batch; ``--losses FILE``: the losses and gradient norms per step, as JSON (rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root

from examples.train_hf_trainer import Patterns, tiny_model


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    from accelerate import Accelerator
    from transformers import default_data_collator, set_seed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("llama", "mixtral", "t5"), default="llama")
    p.add_argument("--objective", choices=("time", "comm"), default="time")
    p.add_argument("--soybean", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--losses", default=None)
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    set_seed(0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=a.grad_accum)
    model = tiny_model(a.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    rows = a.batch * a.grad_accum * a.steps
    loader = torch.utils.data.DataLoader(Patterns(rows, 16, a.model == "t5"), batch_size=a.batch // world,
                                         collate_fn=default_data_collator, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if a.soybean:
        import soybean.hf

        model = soybean.hf.SoybeanModel(model, optimizer=optimizer, objective=a.objective)  # plans at batch 1

    log: list[dict[str, float]] = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = (model.clip_grad_norm_(1.0) if a.soybean
                        else accelerator.clip_grad_norm_(model.parameters(), 1.0))
                log.append({"loss": loss.item(), "grad_norm": norm.item()})
            optimizer.step()
            optimizer.zero_grad()
    if accelerator.is_main_process:
        if a.soybean:
            print(model.describe())
        if a.losses:
            with open(a.losses, "w") as f:
                json.dump(log, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # every rank leaves together and closes its process group
    return log


if __name__ == "__main__":
    main()
