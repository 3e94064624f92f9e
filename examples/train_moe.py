"""Train a Mixtral-shaped mixture of experts (transformers, random weights) on N local gloo processes with soybean's
plan, print where its experts went (the plan's ``moe`` rows), and each step's loss beside serial training's.

    python examples/train_moe.py --nproc 2                    # the plan soybean picks for this model and batch
    python examples/train_moe.py --nproc 2 --objective comm   # least communication: 2-way expert parallelism
    python examples/train_moe.py --nproc 2 --expert-imbalance 2   # routing priced uneven: experts split inside
    soybean plan hf:mixtral --arg hidden_size=256 --arg intermediate_size=1024 --arg num_local_experts=8 \
        --arg num_hidden_layers=2 --arg vocab_size=1024 --arg batch=8 --arg seq=64 --devices 2   # the plan

soybean finds each MoE layer's routed experts in the captured graph (the rows sorted by expert, grouped matmuls,
weighted and summed back per token) and plans them as one op: tokens split, experts split with each row moved to
the rank holding its expert by all-to-all, experts split with the output a pending sum, or every expert split inside
along its FFN dim (tensor parallelism inside the experts: no rank waits on a busier expert, so it wins when the
routing is priced uneven).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soybean
from soybean.models import load

STEPS = 3
ARGS = dict(hidden_size=128, intermediate_size=512, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=256, batch=8, seq=32)


def _model() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return load("hf:mixtral", ARGS)  # the causal LM wrapped to return its loss; (token ids, labels)


def serial_losses() -> list[float]:
    model, inputs = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def train(rank: int, world: int, objective: str, imbalance: float) -> list[float]:
    torch.set_num_threads(1)
    model, inputs = _model()
    pmodel = soybean.parallelize(model, inputs, devices=world, objective=objective, expert_imbalance=imbalance)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = pmodel(*inputs)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    if rank == 0:
        for r in pmodel.plan.moe:
            print(f"{r['layer']}: {r['experts']} experts, top-{r['top_k']}, split {r['degree']}-way on mesh axes "
                  f"{r['axes']} (rows moved by all-to-all on {r['dispatch']}, a pending sum on {r['partial']}), "
                  f"each expert split inside on mesh axes {r['ffn_axes']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--objective", choices=["time", "comm"], default="time")
    ap.add_argument("--expert-imbalance", type=float, default=1.0,
                    help="price the busiest rank's routed rows at F times the balanced share")
    a = ap.parse_args()
    from soybean.runtime.launch import spawn

    got = spawn(train, a.nproc, a.objective, a.expert_imbalance, timeout_s=600)
    ref = serial_losses()
    for step, (s, p) in enumerate(zip(ref, got[0])):
        print(f"step {step}: serial {s:.7f}  soybean {p:.7f}  diff {abs(s - p):.1e}")
    if any(abs(s - p) > 1e-4 * abs(s) for s, p in zip(ref, got[0])):  # float32: sums in another order
        raise SystemExit("soybean's losses differ from serial training's")


if __name__ == "__main__":
    main()
