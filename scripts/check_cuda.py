"""soybean's generated program on a CUDA device: training equal to the eager model, and its step time.

    python scripts/check_cuda.py [--device cuda] [--steps 5] [--timed 20] [--small]

One process per run (world size 1), started the way every soybean run starts (``runtime.launch.spawn``:
``cpu:gloo,cuda:nccl`` when CUDA is there, so the process group is NCCL's for CUDA tensors).  For each model
(the example MLP and transformer in float32, a GPT-2-shaped decoder with bfloat16 weights, and transformers'
``LlamaForCausalLM`` as loaded, its loss computed by the loop from ``out.logits``) it
trains the eager model and soybean's program from the same seed on the device, prints the largest relative
difference of their losses, then times both (median step, CUDA synchronised) and prints the plan's
modelled step under the ``h100-nvlink`` profile beside them, and on CUDA the step's peak of allocated bytes
beside the modelled peak: measured figures for the modelled ones.

A world of one exercises device placement, the backend choice and the generated program on the device, not
a collective between GPUs (every collective of a one-device group is the identity); that needs two GPUs.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.models import mlp, transformer

SMALL: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {  # a smoke test on a CPU (--small)
    "mlp": lambda: mlp(batch=16, hidden=64, layers=2),
    "transformer": lambda: transformer(batch=2, seq=16, hidden=32, layers=2, heads=4),
    "gpt2-bf16": lambda: transformer(batch=2, seq=16, hidden=32, layers=2, heads=4),
    "hf-llama": lambda: _hf_llama(batch=2, seq=16, hidden=32, layers=2, heads=4, vocab=128),
}
MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "mlp": lambda: mlp(batch=256, hidden=1024, layers=4),
    "transformer": lambda: transformer(batch=8, seq=256, hidden=512, layers=4, heads=8),
    "gpt2-bf16": lambda: transformer(batch=8, seq=1024, hidden=768, layers=12, heads=12),
    "hf-llama": lambda: _hf_llama(batch=4, seq=512, hidden=512, layers=4, heads=8, vocab=8192),
}


def _hf_llama(batch: int, seq: int, hidden: int, layers: int, heads: int, vocab: int) -> tuple[torch.nn.Module, tuple]:
    """transformers' Llama as a user loads it: forward returns a ``CausalLMOutputWithPast`` (no labels given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=vocab,
                      max_position_embeddings=seq)
    model = LlamaForCausalLM(cfg).train()
    return model, (torch.randint(0, vocab, (batch, seq)),)


def _to(model: torch.nn.Module, inputs: tuple, device: str, dtype: torch.dtype | None) -> tuple[torch.nn.Module,
                                                                                                  tuple]:
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    inputs = tuple(x.to(device=device, dtype=dtype) if dtype and x.is_floating_point() else x.to(device)
                   for x in inputs)
    return model, inputs


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _train(model: torch.nn.Module, inputs: tuple, steps: int, timed: int,
           device: str) -> tuple[list[float], float, float | None]:
    """The user's loop (AdamW, backward, step, zero_grad): the first ``steps`` losses, then the median of
    ``timed`` more steps' wall seconds and, on CUDA, the most bytes allocated at once during them (the step's
    peak, which ``cost.memory`` models)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        out = model(*inputs)
        if hasattr(out, "logits"):  # a ModelOutput: the loop's next-token loss from its logits
            logits = out.logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs[0][:, 1:].reshape(-1))
        else:
            loss = out if out.dim() == 0 else out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = [float(step().detach()) for _ in range(steps)]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(timed):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    peak = float(torch.cuda.max_memory_allocated()) if cuda else None
    return losses, statistics.median(times) if times else float("nan"), peak


def _rank(rank: int, world: int, device: str, steps: int, timed: int, small: bool) -> list[dict[str, Any]]:
    rows = []
    for name, make in (SMALL if small else MODELS).items():
        dtype = torch.bfloat16 if name.endswith("bf16") else None
        row: dict[str, Any] = {"model": name}
        try:
            _variants(row, make, dtype, device, world, steps, timed)
        except Exception as e:  # one model's failure is reported, the others still run
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def _variants(row: dict[str, Any], make: Callable[[], tuple[torch.nn.Module, tuple]], dtype: torch.dtype | None,
              device: str, world: int, steps: int, timed: int) -> None:
    """Train the eager model, then soybean's program of it, from the same seed, into ``row``."""
    import soybean

    for variant in ("eager", "soybean"):
        torch.manual_seed(0)
        model, inputs = _to(*make(), device, dtype)
        if variant == "soybean":
            model = soybean.parallelize(model, inputs, devices=world, profile="h100-nvlink")
            row["modelled_ms"] = 1e3 * float(model.plan.cost["step_time_s"])
            row["modelled_mib"] = float(model.plan.cost["memory_bytes"]) / 2**20
            row["mesh"] = model.plan.mesh
        losses, t, peak = _train(model, inputs, steps, timed, device)
        row[f"{variant}_losses"], row[f"{variant}_ms"] = losses, 1e3 * t
        row[f"{variant}_mib"] = peak / 2**20 if peak is not None else None
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timed", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="tiny models: a smoke test of the script on a CPU")
    a = ap.parse_args(argv)
    from soybean.runtime.launch import default_backend, spawn

    print(f"device {a.device} ({torch.cuda.get_device_name() if a.device.startswith('cuda') else 'cpu'}), "
          f"torch {torch.__version__}, backend {default_backend()}")
    rows = spawn(_rank, 1, a.device, a.steps, a.timed, a.small, timeout_s=1200)[0]
    worst_all = 0.0
    print(f"{'model':<12} {'mesh':<6} {'max rel. loss diff':>18} {'eager ms':>9} {'soybean ms':>10} {'ratio':>6} "
          f"{'modelled ms (h100-nvlink)':>26} {'peak MiB':>9} {'modelled MiB':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<12} FAILED {r['error']}")
            worst_all = float("inf")
            continue
        worst = max(abs(p - s) / max(abs(s), 1e-12) for p, s in zip(r["soybean_losses"], r["eager_losses"]))
        worst_all = max(worst_all, worst)
        modelled = f"{r['modelled_ms']:.2f}" if r.get("modelled_ms") is not None else "-"
        print(f"{r['model']:<12} {str(r['mesh']):<6} {worst:>18.2e} {r['eager_ms']:>9.2f} {r['soybean_ms']:>10.2f} "
              f"{r['soybean_ms'] / r['eager_ms']:>6.2f} {modelled:>26} "
              f"{r['soybean_mib'] if r['soybean_mib'] is not None else float('nan'):>9.1f} {r['modelled_mib']:>12.1f}")
    return 0 if worst_all < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
