"""``soybean calibrate``: measure this machine and write a profile the cost model uses.

On ``N`` processes of the current backend (gloo on CPU, NCCL on GPUs) it times
all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point for
message sizes from 4 KB to 64 MB, and the compute rate of matmul, convolution
an elementwise op, a skinny linear layer's forward + backward and an AdamW step (one thread per
process, as training runs).  The ring
model of ``cost.py`` predicts ``t = k_steps * alpha + k_bytes * beta`` for each
collective; ``alpha`` and ``beta`` are its least-squares fit over every
measurement (relative error weighted, so small messages count), overall and per
collective (gloo's all-gather is much slower per byte than its all-reduce), and
the JSON keeps the raw table beside them.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .cost import RING_FACTOR
from .profiles import Profile

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _collective(kind: str, nbytes: int, world: int, rank: int, device: torch.device):
    n = max(world, nbytes // 4 // world * world)
    x = torch.ones(n, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":
        out = torch.empty(n * world, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return lambda: gather(out, x)
    if kind == "reduce_scatter":
        out = torch.empty(n // world, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, x)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x)
    peer = rank ^ 1

    def p2p() -> None:  # ranks pair up 0<->1, 2<->3, ...; an odd last rank idles
        if peer < world:
            if rank % 2 == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
    return p2p


def _compute_rates(device: torch.device) -> dict[str, float]:
    """FLOP/s of matmul and conv, bytes/s of an elementwise add, on one thread."""
    a = torch.randn(1024, 1024, device=device)
    t = _median_local(lambda: a @ a, 5)
    img = torch.randn(16, 64, 32, 32, device=device)
    w = torch.randn(64, 64, 3, 3, device=device)
    tc = _median_local(lambda: torch.nn.functional.conv2d(img, w, padding=1), 3)
    big = torch.randn(8 << 20, device=device)
    te = _median_local(lambda: big + big, 5)
    # A skinny linear layer (small batch, 32 MB weight) forward + backward touches the weight about
    # three times (read, read, write its gradient): its rate is what memory-bound training gets.
    lin = torch.nn.Linear(4096, 2048, device=device)
    xs = torch.randn(32, 4096, device=device)

    def fwd_bwd() -> None:
        lin.zero_grad(set_to_none=True)
        lin(xs).sum().backward()

    tl = _median_local(fwd_bwd, 5)
    param = torch.nn.Parameter(torch.randn(8 << 20, device=device))
    param.grad = torch.randn_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3)
    to = _median_local(opt.step, 5)
    mem_bw = min(3 * big.numel() * 4 / te, 3 * lin.weight.numel() * 4 / tl)
    return {"matmul_flops": 2 * 1024**3 / t, "conv_flops": 2 * 16 * 64 * 32 * 32 * 64 * 9 / tc, "mem_bw": mem_bw,
            "optimizer_bw": param.numel() * 4 / to}


def _median_local(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _worker(rank: int, world: int, reps: int, show: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    total = len(KINDS) * len(SIZES)
    for i, (kind, size) in enumerate((k, s) for k in KINDS for s in SIZES):
        t = _median_time(_collective(kind, size, world, rank, device), reps if size < (8 << 20) else max(2, reps // 3))
        rows.append({"kind": kind, "bytes": size, "seconds": t})
        if show and rank == 0:
            done = i + 1
            bar = "#" * (30 * done // total)
            print(f"\rcalibrate [{bar:<30}] {done}/{total} {kind:<14} {size / 2**20:8.3f} MB {t * 1e3:9.3f} ms", end="", file=sys.stderr, flush=True)
    if show and rank == 0:
        print(file=sys.stderr)
    return {"collectives": rows, "compute": _compute_rates(device) if rank == 0 else {}}


def fit(rows: list[dict[str, Any]], world: int) -> tuple[float, float]:
    """Least-squares ``alpha, beta`` of the ring model over every measurement (relative error)."""
    A, b = [], []
    for r in rows:
        kind, m, t = r["kind"], r["bytes"], r["seconds"]
        if kind == "p2p":
            steps, sent = 2.0, 2.0 * m  # send then receive the same message
        else:
            f = RING_FACTOR[kind]
            m_full = m * world if kind == "all_gather" else m
            steps, sent = f * (world - 1), f * (world - 1) / world * m_full
        A.append([steps / t, sent / t])
        b.append(1.0)
    (alpha, beta), *_ = np.linalg.lstsq(np.array(A), np.array(b), rcond=None)
    return max(float(alpha), 1e-7), max(float(beta), 1e-13)


def calibrate(devices: int = 2, reps: int = 10, show: bool = True, name: str = "calibrated") -> tuple[Profile, dict[str, Any]]:
    """Measure on ``devices`` local processes; returns the profile and the raw measurements."""
    from .runtime.launch import spawn

    if devices < 2:
        raise ValueError("calibrate needs --devices >= 2 to measure collectives")
    res = spawn(_worker, devices, reps, show, timeout_s=900)
    rows, comp = res[0]["collectives"], res[0]["compute"]
    alpha, beta = fit(rows, devices)
    per_kind = tuple((k, *fit([r for r in rows if r["kind"] == k], devices)) for k in RING_FACTOR)
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 12.0
    prof = Profile(name, alpha=alpha, beta=beta, flops=comp["matmul_flops"], mem_bw=comp["mem_bw"], memory_gb=mem, conv_flops=comp["conv_flops"],
                   collectives=per_kind, optimizer_bw=comp["optimizer_bw"])
    return prof, {"devices": devices, "collectives": rows, "compute": comp}


def main_cli(devices: int, out: str | None, reps: int) -> int:
    prof, raw = calibrate(devices, reps)
    d = {**asdict(prof), "measurements": raw}
    text = json.dumps(d, indent=1, sort_keys=True) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}: alpha {prof.alpha * 1e6:.1f} us, {1 / prof.beta / 1e9:.2f} GB/s, matmul {prof.flops / 1e9:.1f} GFLOP/s, "
              f"conv {prof.conv_flops / 1e9:.1f} GFLOP/s, memory-bound {prof.mem_bw / 1e9:.1f} GB/s, AdamW {prof.optimizer_bw / 1e9:.2f} GB/s",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
