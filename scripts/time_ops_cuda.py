"""Measured against modelled: one op's forward and training pass on a CUDA device, at the sizes the ``h100-*``
profiles price.

    python scripts/time_ops_cuda.py [--profile h100-nvlink] [--json out.json] [--small]

Each case is one op soybean's planner prices (``cost.compute``): the matmuls of a Llama-3-8B layer at one device's
share of batch 16 x 8K on 8 devices (2 x 8,192 tokens: whole, and split 8 ways as tensor parallelism splits them),
in bfloat16 and in float32 (torch's default: no TF32), causal and full attention (``scaled_dot_product_attention``,
Llama-3-8B's 32 heads of 128 and a tensor-parallel eighth, GPT-2's 12 heads of 64), elementwise ops on an
activation, and torch's AdamW step (multi-tensor, its CUDA default) on a layer's weights.  For each it prints the
median of CUDA-event timings of the forward and of forward + backward, the achieved FLOP/s or bytes/s, and beside
them the modelled seconds: the op's rule's FLOPs and bytes (``cost.compute.flops``), the profile's roofline, and the
passes a training step makes (``cost.compute.passes``).  The ratio measured/modelled is what the profile misses.

``--small`` shrinks every case (a smoke test on a CPU: the timings then mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soybean.cost.compute import compute_seconds, flops, op_flops, optimizer_seconds, passes
from soybean.cost.profiles import load_profile
from soybean.rules.base import OpSpec, TensorSpec


@dataclass(frozen=True)
class Case:
    name: str
    op: OpSpec                                   # the op as the planner prices it
    make: Callable[[], tuple[torch.Tensor, ...]]  # its inputs on the device
    run: Callable[..., torch.Tensor]             # the op
    grads: tuple[bool, ...]                      # which inputs need a gradient in training


def _spec(shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
    return TensorSpec(tuple(shape), dtype)


def _mm(m: int, k: int, n: int, dtype: torch.dtype, device: str, tag: str) -> Case:
    a, b, out = _spec((m, k), dtype), _spec((k, n), dtype), _spec((m, n), dtype)
    op = OpSpec("aten.mm.default", (a, b), {}, (a, b), (out,))

    def make() -> tuple[torch.Tensor, ...]:
        return (torch.randn(m, k, device=device, dtype=dtype).requires_grad_(),
                (torch.randn(k, n, device=device, dtype=dtype) / k ** 0.5).requires_grad_())
    return Case(f"mm {tag} {m}x{k}x{n} {str(dtype)[6:]}", op, make, torch.mm, (True, True))


def _sdpa(b: int, h: int, s: int, d: int, causal: bool, dtype: torch.dtype, device: str, tag: str) -> Case:
    q = _spec((b, h, s, d), dtype)
    op = OpSpec("aten.scaled_dot_product_attention.default", (q, q, q), {"is_causal": causal}, (q, q, q), (q,))

    def make() -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(b, h, s, d, device=device, dtype=dtype).requires_grad_() for _ in range(3))

    def run(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
    return Case(f"sdpa {tag} {b}x{h}x{s}x{d}{' causal' if causal else ''} {str(dtype)[6:]}", op, make, run,
                (True, True, True))


def _elementwise(target: str, fn: Callable[..., torch.Tensor], n_in: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: str) -> Case:
    x = _spec(shape, dtype)
    op = OpSpec(target, (x,) * n_in, {}, (x,) * n_in, (x,))

    def make() -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(*shape, device=device, dtype=dtype).requires_grad_() for _ in range(n_in))
    return Case(f"{target.split('.')[1]} {'x'.join(map(str, shape))} {str(dtype)[6:]}", op, make, fn,
                (True,) * n_in)


def cases(device: str, small: bool) -> list[Case]:
    """Llama-3-8B (hidden 4,096, MLP 14,336, 8 K/V heads of 128, vocabulary 128,256) at 2 x 8,192 tokens on a
    device, whole and split 8 ways; GPT-2's attention at batch 8 x 1,024 (check_cuda.py's decoder)."""
    bf, f32 = torch.bfloat16, torch.float32
    t, h, f, kv, vocab, s = (16384, 4096, 14336, 1024, 128256, 8192) if not small else (64, 32, 112, 8, 1000, 64)
    out = [
        _mm(t, h, h, bf, device, "q/o"), _mm(t, h, kv, bf, device, "k/v"), _mm(t, h, f, bf, device, "up"),
        _mm(t, f, h, bf, device, "down"), _mm(t, h, vocab // 8, bf, device, "lm-head/8"),
        _mm(t, h, h // 8, bf, device, "q/o tp8"), _mm(t, h, f // 8, bf, device, "up tp8"),
        _mm(t, f // 8, h, bf, device, "down tp8"),
        _mm(t, h, h, f32, device, "q/o"), _mm(t, h, f, f32, device, "up"),
        _sdpa(2, 32, s, 128 if not small else 8, True, bf, device, "llama"),
        _sdpa(2, 32, s, 128 if not small else 8, False, bf, device, "llama"),
        _sdpa(2, 4, s, 128 if not small else 8, True, bf, device, "llama tp8"),
        _sdpa(8, 12, 1024 if not small else 32, 64 if not small else 8, True, bf, device, "gpt2"),
        _elementwise("aten.add.Tensor", torch.add, 2, (t, h), bf, device),
        _elementwise("aten.mul.Tensor", torch.mul, 2, (t, f), bf, device),
        _elementwise("aten.silu.default", F.silu, 1, (t, f), bf, device),
        _elementwise("aten.add.Tensor", torch.add, 2, (t, h), f32, device),
    ]
    return out


def _time(fn: Callable[[], Any], device: str, reps: int, warm: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (CUDA events on a GPU, wall clock otherwise)."""
    import time
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(case: Case, device: str, reps: int, profile_name: str) -> dict[str, Any]:
    profile = load_profile(profile_name)
    xs = case.make()
    grad_out = torch.randn_like(case.run(*xs))

    def forward() -> None:
        with torch.no_grad():
            case.run(*xs)

    def train() -> None:
        torch.autograd.grad(case.run(*xs), [x for x, g in zip(xs, case.grads) if g], grad_out)

    fwd, both = _time(forward, device, reps), _time(train, device, reps)
    n_flops, n_bytes = flops(case.op)
    n_pass = passes(case.op, list(case.grads))
    profile = replace(profile, flops=op_flops(case.op, profile))  # float32 at its own rate
    m_fwd = compute_seconds(n_flops, n_bytes, 1.0, profile, 1.0)
    m_both = compute_seconds(n_flops, n_bytes, 1.0, profile, n_pass)
    matmul_like = case.name.startswith(("mm", "sdpa"))
    return {"case": case.name, "flops": n_flops, "bytes": n_bytes, "fwd_s": fwd, "train_s": both,
            "modelled_fwd_s": m_fwd, "modelled_train_s": m_both, "passes": n_pass,
            "achieved": (n_flops if matmul_like else n_bytes) / fwd, "unit": "FLOP/s" if matmul_like else "B/s"}


def adamw(device: str, reps: int, profile_name: str, small: bool) -> dict[str, Any]:
    """torch's AdamW (multi-tensor on CUDA) over one Llama-3-8B layer's weights in float32."""
    h, f, kv = (4096, 14336, 1024) if not small else (32, 112, 8)
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    ps = [torch.nn.Parameter(torch.randn(*s, device=device)) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-4)
    t = _time(opt.step, device, reps)
    nbytes = [p.numel() * 4 for p in ps]
    profile = load_profile(profile_name)
    modelled = sum(optimizer_seconds(n, profile) for n in nbytes)
    return {"case": f"adamw 1 layer {sum(nbytes) / 2**20:.0f} MiB fp32", "flops": 0.0, "bytes": float(sum(nbytes)),
            "fwd_s": t, "train_s": t, "modelled_fwd_s": modelled, "modelled_train_s": modelled, "passes": 1.0,
            "achieved": sum(nbytes) / t, "unit": "param B/s"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", default="h100-nvlink")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--small", action="store_true", help="tiny sizes: a smoke test of the script on a CPU")
    a = ap.parse_args(argv)
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"device {a.device} ({name}), torch {torch.__version__}, modelled under {a.profile}")
    rows = [measure(c, a.device, a.reps, a.profile) for c in cases(a.device, a.small)]
    rows.append(adamw(a.device, a.reps, a.profile, a.small))
    print(f"{'case':<44} {'fwd ms':>8} {'model':>8} {'ratio':>6} {'train ms':>9} {'model':>8} {'ratio':>6} "
          f"{'achieved (fwd)':>16}")
    for r in rows:
        print(f"{r['case']:<44} {1e3 * r['fwd_s']:>8.3f} {1e3 * r['modelled_fwd_s']:>8.3f} "
              f"{r['fwd_s'] / r['modelled_fwd_s']:>6.2f} {1e3 * r['train_s']:>9.3f} "
              f"{1e3 * r['modelled_train_s']:>8.3f} {r['train_s'] / r['modelled_train_s']:>6.2f} "
              f"{r['achieved'] / 1e12:>9.1f} T{r['unit']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": name, "torch": torch.__version__, "profile": a.profile, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
