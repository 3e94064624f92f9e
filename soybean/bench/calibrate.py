"""``soybean calibrate``: measure this machine and write a profile the cost model uses.

On ``N`` processes of the current backend (gloo on CPU, NCCL on GPUs) it times every collective of
``runtime.algorithms`` (broadcast, reduce, all-reduce, all-gather, reduce-scatter) run by each algorithm (the
backend's own call, soybean's ``lp``, ``ring`` and ``tree``, as the generated programs run them, packing copies
included), the algorithms of one collective taking turns; the backend's all-to-all and point-to-point; for
message sizes from 4 KB to 64 MB, every 4x.  It also times the compute rate of matmul, convolution, an
elementwise op, first-touching a large fresh allocation, an AdamW step and the fixed cost of an op's pass
(a chain of tiny ops trained; one thread per process, all
processes at once, as training runs), how much of an asynchronous gradient all-reduce hides behind compute,
and what a blocking collective costs amid compute beyond its barrier-aligned time.

Each (collective, algorithm) row is fitted to its own rounds and bytes (``ir.algorithms.terms``;
the all-to-all to the ring model): ``t = rounds alpha + bytes beta``, least squares in relative error (so
small messages count).  The profile's ``collectives`` get one entry per collective for the backend's call
(``all_reduce``) and one per soybean algorithm (``all_reduce:lp``), a ``p2p`` entry fitted over all of
soybean's, and ``alpha``, ``beta`` fitted over everything.  One line does not follow a bandwidth that
changes with the message (on this CPU a 64 MB message moves at 30-75% of a 4 MB one's rate), so each
entry also gets ``beta_curves``: with its fitted alpha, the beta that gives back each measured time
(``beta_curve``), interpolated in log message size by ``Profile.ab``.  The JSON keeps the raw table.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..cost.profiles import BUILTIN, LARGE_ALLOC, Profile
from ..ir.kinds import RING_FACTOR
from ..runtime import algorithms as A
from ..runtime.comm import TorchGroup

# Every 4x: bandwidth changes with the message (``Profile.beta_curves``), so the curve needs its points close.
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
# timed on their own: the backend's all-to-all and one point-to-point exchange
KINDS = ["all_to_all", "p2p"]
# each collective of ``runtime.algorithms`` by every algorithm, taking turns (the backend's call keyed by the
# collective's name, as ``Profile.ab`` reads it), fitted to ``algorithms.terms``
ALGO_KINDS = [f"{c}:{a}" for c in A.COLLECTIVES for a in A.P2P] + list(A.COLLECTIVES)


def _done() -> None:
    """Wait for queued GPU work (kernels and NCCL collectives run asynchronously): time it done,
    not launched.  Nothing to wait for on a CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_time(fn, reps: int) -> float:
    """Median seconds of ``fn`` on every rank, each run started right after a barrier."""
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _done()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def fastest_medians(fns: Sequence[Callable[[], Any]], reps: int, rounds: int = 3) -> tuple[float, ...]:
    """The :func:`_median_time` of each of ``fns`` in ``rounds`` alternating rounds, the fastest
    round of each: outside load only ever adds time."""
    medians = [[_median_time(fn, reps) for fn in fns] for _ in range(rounds)]
    return tuple(min(m[i] for m in medians) for i in range(len(fns)))


COLS = 256  # every timed tensor is (rows, COLS) float32, like an activation or a weight


def _collective(group: TorchGroup, kind: str, nbytes: int, world: int, rank: int, device: torch.device):
    """The call to time for one of ``KINDS``: the runtime's own all-to-all (``group``'s, packing copies included)
    or a point-to-point exchange, on a tensor of ``nbytes``."""
    rows = max(world, nbytes // 4 // COLS // world * world)
    x = torch.ones(rows, COLS, device=device)
    if kind == "all_to_all":
        # my column block of every row -> my row block of every column (S(1) -> S(0))
        return lambda: group.all_to_all(x, 1, 0, COLS * world)
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


def split_kind(key: str) -> tuple[str, str]:
    """``"all_reduce:lp"`` -> ``("all_reduce", "lp")``; ``"broadcast"`` -> ``("broadcast", "backend")``."""
    kind, _, algo = key.partition(":")
    return kind, algo or A.BACKEND


def prior_chunks(collective: str, m: float, world: int, device: torch.device) -> int:
    """The lp chunk count to measure with: the built-in profile's choice for this device type."""
    prior = BUILTIN["h100-nvlink" if device.type == "cuda" else "cpu-gloo"]
    return int(A.lp_chunks(collective, m, world, *prior.ab(0, collective, "lp")))


def _chunk_counts(collective: str, algorithm: str, m: int, world: int, device: torch.device) -> list[int]:
    """The chunk counts to time ``algorithm`` with: lp's on a chain whose rounds grow with them (broadcast,
    reduce, all-reduce) at the built-in profile's choice and at 4x it, so the fit sees what one more round
    costs (alpha) apart from what the bytes cost; one otherwise."""
    if algorithm != "lp":
        return [1]
    k = prior_chunks(collective, m, world, device)
    rounds_grow = A.terms(collective, "lp", m, world, 1)[0] != A.terms(collective, "lp", m, world, 2)[0]
    return sorted({k, min(4 * k, A.MAX_CHUNKS)}) if rounds_grow else [k]


def algorithm_call(group: TorchGroup, collective: str, algorithm: str, m: int, world: int, device: torch.device,
                   chunks: int = 1) -> tuple[Callable[[], Any], int]:
    """The call to time for ``collective`` run by ``algorithm`` (``runtime.algorithms``) on a message of about
    ``m`` bytes (the kinds table's message: the buffer; the full result of an all-gather, the full input of a
    reduce-scatter), and the message's exact bytes."""
    rows = _rows(m, world)
    algo = (algorithm, chunks)
    if collective == "all_gather":
        x = torch.ones(rows // world, COLS, device=device)
        return (lambda: A.all_gather(group, x, 0, rows, algo)), message_bytes(m, world)
    x = torch.ones(rows, COLS, device=device)
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: A.all_reduce(group, x, algo),
        "reduce_scatter": lambda: A.reduce_scatter(group, x, 0, algo),
        "broadcast": lambda: A.broadcast(group, x, 0, algo),
        "reduce": lambda: A.reduce(group, x, 0, algo),
    }
    return calls[collective], message_bytes(m, world)


def _rows(m: int, world: int) -> int:
    return max(world, m // 4 // COLS // world * world)


def message_bytes(m: int, world: int) -> int:
    """The exact message ``algorithm_call`` times for about ``m`` bytes: whole (rows, COLS) float32 rows, a
    multiple of ``world`` of them."""
    return _rows(m, world) * COLS * 4


def _compute_rates(device: torch.device, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """On one thread: FLOP/s of matmul (in a linear layer's training step) and conv; bytes/s of an
    elementwise op on activation-sized (4 MiB, reused) tensors; bytes/s of first-touching a fresh
    large (32 MiB) allocation, on a CPU; and the parameter bytes/s of an AdamW step.  ``sync`` runs
    before each measurement (a barrier: every rank times the same kernel at the same time,
    contending as in training)."""
    # The matmul rate as training gets it: a linear layer's forward and backward (three products,
    # plus the bias, the autograd bookkeeping and the allocations that come with them).
    lin = torch.nn.Linear(1024, 1024, device=device)
    xin = torch.randn(1024, 1024, device=device, requires_grad=True)

    def linear_step() -> None:
        lin.zero_grad(set_to_none=True)
        xin.grad = None
        lin(xin).sum().backward()

    sync()
    t = _median_local(linear_step, 9) / 3
    low: dict[str, float] = {}
    if device.type == "cuda":  # tensor cores: bf16 an order of magnitude faster than float32 without TF32
        lin, xin = lin.to(torch.bfloat16), xin.detach().to(torch.bfloat16).requires_grad_()
        sync()
        low["matmul_bf16_flops"] = 2 * 1024**3 / (_median_local(linear_step, 9) / 3)
    img = torch.randn(16, 64, 32, 32, device=device)
    w = torch.randn(64, 64, 3, 3, device=device)
    sync()
    tc = _median_local(lambda: torch.nn.functional.conv2d(img, w, padding=1), 5)
    act = torch.randn(1 << 20, device=device)
    sync()
    te = _median_local(lambda: torch.relu(act), 15)
    alloc_bw = 0.0
    if device.type == "cpu":
        # x + x on a fresh 32 MiB result against the same on a reused one: the difference is the
        # page faults (the caching allocator of a GPU has none).
        big = torch.randn(LARGE_ALLOC // 4, device=device)
        out = torch.empty_like(big)
        sync()
        t_fresh = _median_local(lambda: big + big, 5)
        sync()
        t_reused = _median_local(lambda: torch.add(big, big, out=out), 5)
        alloc_bw = LARGE_ALLOC / max(t_fresh - t_reused, 1e-6)
    rates = {}
    # 4 MiB; 32 MiB (page faults on a CPU)
    for key, numel in (("optimizer_bw", 1 << 20), ("optimizer_large_bw", LARGE_ALLOC // 4)):
        param = torch.nn.Parameter(torch.randn(numel, device=device))
        param.grad = torch.randn_like(param)
        opt = torch.optim.AdamW([param], lr=1e-3)
        sync()
        rates[key] = numel * 4 / _median_local(opt.step, 5)
        del param, opt
    # The fixed cost per parameter tensor: a step over 64 tiny tensors.
    tiny = [torch.nn.Parameter(torch.randn(16, device=device)) for _ in range(64)]
    for p in tiny:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(tiny, lr=1e-3)
    sync()
    rates["optimizer_tensor_s"] = _median_local(opt.step, 5) / len(tiny)
    sync()
    rates["op_s"] = _op_overhead(device)
    return {"matmul_flops": 2 * 1024**3 / t, "conv_flops": 2 * 16 * 64 * 32 * 32 * 64 * 9 / tc,
            "mem_bw": 2 * act.numel() * 4 / te, "alloc_bw": alloc_bw, **rates, **low}


OP_CHAIN = 64


def _op_overhead(device: torch.device) -> float:
    """Fixed seconds of one pass of an op (``Profile.op_s``): a chain of ``OP_CHAIN`` multiplications of a
    16-element tensor trained, forward and backward (``2 OP_CHAIN`` passes, the sum and its backward besides),
    whose arithmetic is nothing: dispatcher, autograd node, allocation and launch."""
    x = torch.randn(16, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(OP_CHAIN):
            y = y * 1.0001
        y.sum().backward()

    return _median_local(chain, 15) / (2 * OP_CHAIN)


def _median_local(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _done()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _grad_overlap(group: TorchGroup, device: torch.device, reps: int) -> float:
    """The share of an asynchronous gradient all-reduce hidden behind concurrent compute.

    Times an 8 MB bucket's async all-reduce alone (``t_c``), a matmul loop about twice as long
    alone (``t_m``), and both together (``t_b``, the loop running while the all-reduce is in
    flight, as ``GradSync`` overlaps backward): hidden = ``(t_c + t_m - t_b) / t_c``, clamped to
    [0, 1].  Every rank runs it (the all-reduce is collective).
    """
    flat = torch.ones(2 << 20, device=device)
    a = torch.randn(512, 512, device=device)

    def comm() -> None:
        group.all_reduce_inplace_async(flat).wait()

    t1 = _median_time(lambda: a @ a, reps)
    tc = _median_time(comm, reps)
    n = max(1, round(2 * tc / max(t1, 1e-9)))  # all ranks must loop alike: agree on the count
    count = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    n = int(count.item())

    def compute() -> None:
        for _ in range(n):
            a @ a

    def both() -> None:
        work = group.all_reduce_inplace_async(flat)
        compute()
        work.wait()

    tc, tm, tb = fastest_medians((comm, compute, both), reps)
    return float(min(1.0, max(0.0, (tc + tm - tb) / tc)))


BLOCKING_SEGMENTS = 8


def _blocking_cost(group: TorchGroup, device: torch.device, reps: int) -> float:
    """Extra seconds a blocking collective costs between two stretches of compute.

    The collectives above are timed right after a barrier, every rank ready at once.  In a
    program a rank reaches a blocking collective after compute and waits for the others there.
    Times ``BLOCKING_SEGMENTS`` matmul stretches (~1 ms each on the CPU box) with a small
    all-reduce after each (``t_a``), the same stretches with one all-reduce at the end (``t_b``),
    and that all-reduce alone after a barrier (``t_c``): each of the ``n - 1`` extra all-reduces
    costs ``(t_a - t_b) / (n - 1)``, of which ``t_c`` is its own latency and the rest is this
    cost.  Three rounds, the fastest of each (:func:`fastest_medians`); clamped at 0.
    """
    tiny = torch.ones(16, device=device)
    a = torch.randn(384, 384, device=device)
    n = BLOCKING_SEGMENTS

    def each() -> None:
        for _ in range(n):
            a @ a
            group.all_reduce(tiny)

    def once() -> None:
        for _ in range(n):
            a @ a
        group.all_reduce(tiny)

    ta, tb, tc = fastest_medians((each, once, lambda: group.all_reduce(tiny)), reps)
    return float(max(0.0, (ta - tb) / (n - 1) - tc))


def _worker(rank: int, world: int, reps: int, show: bool, sizes: Sequence[int] = tuple(SIZES)) -> dict[str, Any]:
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    group = TorchGroup(dist.group.WORLD)  # the runtime's own collectives, as the generated programs call them
    rows = []
    total = len(KINDS) * len(sizes)
    for i, (kind, size) in enumerate((k, s) for k in KINDS for s in sizes):
        n = reps if size < (8 << 20) else max(2, reps // 3)
        t = _median_time(_collective(group, kind, size, world, rank, device), n)
        rows.append({"kind": kind, "bytes": size, "seconds": t})
        if show and rank == 0:
            done = i + 1
            bar = "#" * (30 * done // total)
            print(f"\rcalibrate [{bar:<30}] {done}/{total} {kind:<14} {size / 2**20:8.3f} MB {t * 1e3:9.3f} ms",
                  end="", file=sys.stderr, flush=True)
    # One collective's algorithms take turns (three rounds, the fastest median of each), as
    # scripts/bench_collectives.py times them: drift favours none.
    groups = [(c, [k for k in ALGO_KINDS if split_kind(k)[0] == c]) for c in dict.fromkeys(
        split_kind(k)[0] for k in ALGO_KINDS)]
    total = len(ALGO_KINDS) * len(sizes)  # calls: keys, lp's extra chunk count not counted
    done = 0
    for (coll, keys), size in ((g, s) for g in groups for s in sizes):
        calls, meta = [], []
        for key in keys:
            kind, algo = split_kind(key)
            for k in _chunk_counts(kind, algo, size, world, device):
                fn, m = algorithm_call(group, kind, algo, size, world, device, k)
                calls.append(fn)
                meta.append((key, m, k))
        times = fastest_medians(calls, reps if size < (8 << 20) else max(2, reps // 3))
        for (key, m, k), t in zip(meta, times):
            rows.append({"kind": key, "bytes": m, "seconds": t, "chunks": k})
        done += len(keys)
        if show and rank == 0:
            bar = "#" * (30 * done // total)
            print(f"\ralgorithms [{bar:<30}] {done}/{total} {coll:<15} {'/'.join(split_kind(k)[1] for k in keys):<16} "
                  f"{size / 2**20:8.3f} MB", end="", file=sys.stderr, flush=True)
    if show and rank == 0:
        print(file=sys.stderr)
    overlap = _grad_overlap(group, device, reps)
    blocking = _blocking_cost(group, device, reps)
    # Every rank measures at once, as every rank computes at once in training: cores that share
    # caches, memory bandwidth or a physical core run slower together than one alone.
    rates = _compute_rates(device, dist.barrier)
    compute = {**rates, "grad_overlap": overlap, "blocking_s": blocking} if rank == 0 else {}
    return {"collectives": rows, "compute": compute}


def _terms(r: dict[str, Any], world: int) -> tuple[float, float, float]:
    """(rounds, bytes sent, message) of a measurement row: a row of one of ``ALGO_KINDS`` by its algorithm's own
    rounds and bytes (``ir.algorithms.terms``; the message is the kinds table's: an all-gather's full
    result), an all-to-all by the ring model."""
    kind, m = r["kind"], r["bytes"]
    if kind in ALGO_KINDS:
        rounds, by = A.terms(*split_kind(kind), m, world, r.get("chunks", 1))
        return float(rounds), float(by), float(m)
    if kind == "p2p":
        return 2.0, 2.0 * m, float(m)  # send then receive the same message
    f = RING_FACTOR[kind]
    return f * (world - 1), f * (world - 1) / world * m, float(m)


def fit(rows: list[dict[str, Any]], world: int) -> tuple[float, float]:
    """Least-squares ``alpha, beta`` of ``rounds alpha + bytes beta`` over every measurement (relative error;
    ``_terms``)."""
    A_, b = [], []
    for r in rows:
        steps, sent, _ = _terms(r, world)
        A_.append([steps / r["seconds"], sent / r["seconds"]])
        b.append(1.0)
    (alpha, beta), *_ = np.linalg.lstsq(np.array(A_), np.array(b), rcond=None)
    return max(float(alpha), 1e-7), max(float(beta), 1e-13)


# Least share of a measurement the bandwidth term keeps in ``beta_curve``: where latency is all of it, beta is
# not measured (any small beta fits); the floor keeps the curve positive.
MIN_BANDWIDTH_SHARE = 0.05


def beta_curve(rows: list[dict[str, Any]], world: int, alpha: float) -> tuple[tuple[float, float], ...]:
    """``((m, beta), ...)`` for one key's measurements, m ascending: the beta that, with the key's fitted
    ``alpha``, gives each measured time exactly, ``beta(m) = (t - rounds alpha) / bytes`` (the bandwidth term
    at least ``MIN_BANDWIDTH_SHARE`` of ``t``; the mean over rows of one message, lp's chunk counts).
    ``Profile.ab`` interpolates it in log m: the fitted line's error where bandwidth changes with the message
    (caches at 64 MB on CPU) goes."""
    at: dict[float, list[float]] = {}
    for r in rows:
        steps, sent, m = _terms(r, world)
        if sent > 0:
            t = float(r["seconds"])
            at.setdefault(m, []).append(max(t - steps * alpha, MIN_BANDWIDTH_SHARE * t) / sent)
    return tuple((m, float(np.mean(b))) for m, b in sorted(at.items()))  # lp's chunk counts: their mean


def calibrate(devices: int = 2, reps: int = 10, show: bool = True,
              name: str = "calibrated", sizes: Sequence[int] = tuple(SIZES)) -> tuple[Profile, dict[str, Any]]:
    """Measure on ``devices`` local processes; returns the profile and the raw measurements.  ``sizes``: the
    message bytes each collective is timed at (``SIZES``; two or more, for the fits)."""
    from ..runtime.launch import spawn

    if devices < 2:
        raise ValueError("calibrate needs --devices >= 2 to measure collectives")
    if len(set(sizes)) < 2:
        raise ValueError(f"calibrate needs two message sizes or more to fit a latency and a bandwidth, got {sizes}")
    res = spawn(_worker, devices, reps, show, tuple(sizes), timeout_s=900)
    rows, comp = res[0]["collectives"], res[0]["compute"]
    alpha, beta = fit(rows, devices)
    # the backend's calls (RING_FACTOR's names, also in ALGO_KINDS) and soybean's algorithms, one entry each
    per_kind = tuple((k, *fit([r for r in rows if r["kind"] == k], devices))
                     for k in dict.fromkeys([*RING_FACTOR, *ALGO_KINDS]))
    curves = tuple((k, beta_curve([r for r in rows if r["kind"] == k], devices, a)) for k, a, _ in per_kind)
    per_kind += (("p2p", *fit([r for r in rows if r["kind"] in ALGO_KINDS and ":" in r["kind"]], devices)),)
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 12.0
    # on a GPU ``flops`` is bf16's rate and float32's its own (``fp32_flops``); on a CPU one rate for both
    bf16 = comp.get("matmul_bf16_flops", 0.0)
    prof = Profile(name, alpha=alpha, beta=beta, flops=bf16 or comp["matmul_flops"], mem_bw=comp["mem_bw"],
                   memory_gb=mem, fp32_flops=comp["matmul_flops"] if bf16 else 0.0, conv_flops=comp["conv_flops"],
                   collectives=per_kind, optimizer_bw=comp["optimizer_bw"],
                   optimizer_large_bw=comp["optimizer_large_bw"], optimizer_tensor_s=comp["optimizer_tensor_s"],
                   grad_overlap=comp["grad_overlap"], alloc_bw=comp["alloc_bw"],
                   large_alloc=float(LARGE_ALLOC) if comp["alloc_bw"] else 0.0, blocking_s=comp["blocking_s"],
                   op_s=comp["op_s"], beta_curves=curves, optimizer_foreach=torch.cuda.is_available())
    return prof, {"devices": devices, "collectives": rows, "compute": comp}


def main_cli(devices: int, out: str | None, reps: int) -> int:
    prof, raw = calibrate(devices, reps)
    d = {**asdict(prof), "measurements": raw}
    text = json.dumps(d, indent=1, sort_keys=True) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}: alpha {prof.alpha * 1e6:.1f} us, {1 / prof.beta / 1e9:.2f} GB/s, "
              f"matmul {prof.flops / 1e9:.1f} GFLOP/s, conv {prof.conv_flops / 1e9:.1f} GFLOP/s, "
              f"memory-bound {prof.mem_bw / 1e9:.1f} GB/s, large allocations {prof.alloc_bw / 1e9:.1f} GB/s, "
              f"AdamW {prof.optimizer_bw / 1e9:.2f} GB/s ({prof.optimizer_large_bw / 1e9:.2f} on 32 MiB) "
              f"+ {prof.optimizer_tensor_s * 1e6:.0f} us a tensor, gradient sync hidden {prof.grad_overlap:.0%}, "
              f"a blocking collective amid compute +{prof.blocking_s * 1e6:.0f} us, "
              f"an op's pass +{prof.op_s * 1e6:.1f} us",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
