"""Planner speed on the shapes users meet: the whole ``soybean plan`` command, timed as a user runs it.

    python scripts/bench_planner.py                       # every case below (~50 minutes on 2 cores with --timeout 600)
    python scripts/bench_planner.py --cases gpt2-12,llama3-8b-8
    python scripts/bench_planner.py --json > planner.json

Each case runs ``soybean plan ... --format json`` in a fresh process, capture included, on the meta
device (no weight is allocated), twice: the first run builds and exports the model into an empty capture cache
(``soybean.capture.cache``, a directory of this run's own), the second reads it, as a user iterating on options
does.  It reports both wall times, the first run's peak resident memory (``wait4``), the solver's status and gap,
the mesh it chose, its modelled step time and memory per device, and the modelled step time of every baseline
priced beside it (``infeasible`` when the baseline cannot run; a baseline made to fit by activation checkpointing
says which).
A second table turns the Llama-3 cases into modelled weak scaling, tokens per second per GPU, beside
torchtitan's published measurements.

Every step time here is modelled with the built-in H100 profiles (``soybean.cost.profiles``: H100 SXM
datasheet, NCCL tests; NVLink inside a node, 400 Gb/s InfiniBand across nodes), not measured: there is
no GPU on the machine this runs on.  Llama-3-8B on 8 and 64 devices is fp32, as transformers builds it; the
cluster cases (8B on 1,024, 70B on 64 and 512) plan bf16-mixed with ``--recompute auto`` (the default) within
``--memory-gb 80``, as experts train them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPT2_SMALL = ["hf:gpt2", "--arg", "meta=True", "--arg", "batch=8", "--arg", "seq=1024"]


SEQ = 8192


def _hf(model_type: str, **args: object) -> list[str]:
    """``hf:<model_type>`` on the meta device with ``args`` as ``--arg key=value``."""
    return [f"hf:{model_type}"] + [x for k, v in {"meta": "True", **args}.items() for x in ("--arg", f"{k}={v}")]


def _llama(layers: int, hidden: int, heads: int, ffn: int, seq: int = SEQ) -> list[str]:
    return _hf("llama", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
               num_key_value_heads=8, intermediate_size=ffn, vocab_size=128256, seq=seq, max_position_embeddings=seq)


LLAMA3_8B = _llama(32, 4096, 32, 14336)
LLAMA3_70B = _llama(80, 8192, 64, 28672)
# Llama-3-8B at 128K tokens a sequence (issue 23's long context).
LLAMA3_8B_128K = _llama(32, 4096, 32, 14336, seq=131072)
# Mixtral-8x7B: 32 layers of 8 experts, 2 per token, 4K tokens a sequence.
MIXTRAL_8X7B = _hf("mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, seq=4096,
                   max_position_embeddings=4096)


@dataclass(frozen=True)
class Case:
    name: str
    model: list[str]
    devices: int
    batch: int            # global batch (sequences per step)
    extra: tuple[str, ...] = ()
    seq: int = SEQ        # tokens per sequence
    family: str = ""      # the model in the weak-scaling table ("": not in it)


def _cluster(devices: int, bf16: bool = False) -> tuple[str, ...]:
    """One node of 8 H100s on NVLink; more devices: nodes of 8 joined by InfiniBand (``bf16``: bf16-mixed)."""
    prec = ("--precision", "bf16-mixed") if bf16 else ()
    if devices <= 8:
        return ("--profile", "h100-nvlink", "--memory-gb", "80", *prec)
    return ("--profile", "h100-nvlink-ib", "--gpus-per-node", "8", "--memory-gb", "80", *prec)


CASES = [
    Case("gpt2-12", GPT2_SMALL + ["--arg", "n_layer=12"], 8, 8, ("--profile", "h100-nvlink")),
    Case("gpt2-48", GPT2_SMALL + ["--arg", "n_layer=48"], 8, 8, ("--profile", "h100-nvlink")),
    # Issue 17's settings: 8B fp32 at batch 1 on 8 and batch 8 on 64; the cluster cases in bf16-mixed.
    Case("llama3-8b-8", LLAMA3_8B, 8, 1, _cluster(8), family="llama3-8b"),
    Case("llama3-8b-64", LLAMA3_8B, 64, 8, _cluster(64), family="llama3-8b"),
    Case("llama3-8b-1024", LLAMA3_8B, 1024, 128, _cluster(1024, bf16=True), family="llama3-8b"),
    Case("llama3-70b-64", LLAMA3_70B, 64, 8, _cluster(64, bf16=True), family="llama3-70b"),
    Case("llama3-70b-512", LLAMA3_70B, 512, 256, _cluster(512, bf16=True), family="llama3-70b"),
    # Issue 25's loss outside: the model returns its ModelOutput and the loop computes the loss from the logits.
    Case("llama3-8b-1024-raw", LLAMA3_8B + ["--arg", "raw=True"], 1024, 128, _cluster(1024, bf16=True)),
    Case("qwen2-8b-1024-raw", ["hf:qwen2"] + LLAMA3_8B[1:] + ["--arg", "raw=True"], 1024, 128,
         _cluster(1024, bf16=True)),
    # Issue 25's rows where the memory budget binds: 8B at batch 16 on one node in fp32, Mixtral on 64, 128K tokens.
    Case("llama3-8b-8-b16", LLAMA3_8B, 8, 16, _cluster(8), family="llama3-8b"),
    Case("mixtral-8x7b-64", MIXTRAL_8X7B, 64, 64, _cluster(64, bf16=True), seq=4096, family="mixtral-8x7b"),
    Case("llama3-8b-128k-64", LLAMA3_8B_128K, 64, 8, _cluster(64, bf16=True), seq=131072,
         family="llama3-8b-128k"),
    Case("llama3-8b-128k-64-b1", LLAMA3_8B_128K, 64, 1, _cluster(64, bf16=True), seq=131072,
         family="llama3-8b-128k"),
]

# torchtitan's published measurements (docs/performance.md, github.com/pytorch/torchtitan): Llama 3.1 8B
# on 8 H100 (96 GB HBM2e, 500 W), FSDP, local batch 2, sequence 8,192, bf16, selective activation
# checkpointing: tokens/s/GPU.  Measured, on real GPUs, in bf16; our figures are modelled, in fp32.
TORCHTITAN = {
    ("llama3-8b", 8): "5,762 (FSDP); 6,667 (+torch.compile); 8,532 (+Float8)",
    # Llama 3 70B as FSDP x TP 8 with activation checkpointing, measured on 256 H100s (the figure).
    ("llama3-70b", 512): "829 (FSDP x TP8, activation checkpointing, on 256 H100s)",
}


def run(case: Case, time_limit: float, timeout: float, cache: str, jobs: int | None = None) -> dict:
    """``soybean plan`` for ``case`` in a fresh process, twice (the second reading the capture cache the first
    filled): both wall times, the first run's peak RSS (``wait4``: its largest process) and the peak of its
    processes' RSS summed (sampled: the planner's workers, ``--jobs``), and its plan JSON."""
    first = _run_once(case, time_limit, timeout, cache, jobs)
    if "error" not in first:
        second = _run_once(case, time_limit, timeout, cache, jobs)
        first["second_wall_s"] = second["wall_s"]
    return first


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it, now (0 for any that has ended)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def _sample_rss(pid: int, peak: list[int], done: threading.Event) -> None:
    while not done.wait(0.25):
        peak[0] = max(peak[0], _tree_rss(pid))


def _run_once(case: Case, time_limit: float, timeout: float, cache: str, jobs: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "plan.json"), os.path.join(tmp, "stderr")
        cmd = [sys.executable, "-m", "soybean.cli", "plan", *case.model, "--arg", f"batch={case.batch}",
               "--devices", str(case.devices), *case.extra, "--time-limit", str(time_limit),
               "--format", "json", "--out", out, "--quiet", *(["--jobs", str(jobs)] if jobs else [])]
        t0 = time.perf_counter()
        with open(err, "w") as ef:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=ef,
                                    env={**os.environ, "SOYBEAN_CACHE_DIR": cache, "SOYBEAN_NO_CACHE": "0"})
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            peak, done = [0], threading.Event()
            sampler = threading.Thread(target=_sample_rss, args=(proc.pid, peak, done), daemon=True)
            if os.path.exists("/proc"):
                sampler.start()
            _, status, usage = os.wait4(proc.pid, 0)
            done.set()
            timer.cancel()
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if code != 0 or not os.path.exists(out):
            lines = open(err).read().strip().splitlines()
            why = f"no plan within {timeout:g} s" if wall >= timeout else lines[-1] if lines else f"exit {code}"
            return {"case": case.name, "devices": case.devices, "wall_s": round(wall, 1), "error": why}
        with open(out) as f:
            plan = json.load(f)
    cost, solver = plan["cost"], plan["solver"]
    return {
        "case": case.name, "devices": case.devices, "global_batch": case.batch, "seq": case.seq,
        "family": case.family, "wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
        "peak_rss_sum_gb": round(peak[0] / 2**30, 2),
        "mesh": "x".join(map(str, plan["mesh"])),
        "status": solver["status"], "gap": solver["gap"], "step_s": cost["step_time_s"],
        "memory_gb": round(cost["memory_bytes"] / 2**30, 1), "tied": plan.get("tying", {}).get("used", False),
        "baselines": {k: v.get("step_time_s", "infeasible") for k, v in sorted(plan["baselines"].items())},
        "checkpointed": {k: v["recompute"] for k, v in plan["baselines"].items() if "recompute" in v},
        "recomputed": len(plan.get("recompute", [])), "precision": plan.get("precision", "fp32"),
    }


def _gap(g: float) -> str:
    """The gap in percent, to two decimals, or to one significant digit where those read 0.00% of a plan that is
    not proven optimal (its status says "feasible")."""
    return f"{g:.2%}" if g == 0 or g >= 5e-5 else f"{g * 100:.1g}%"


def _ms(x: float | str) -> str:
    return f"{x * 1e3:.1f}" if isinstance(x, float) else str(x)


def table(rows: list[dict]) -> str:
    head = (f"{'case':<15} {'dev':>5} {'batch':>5} {'wall s':>7} {'again s':>7} {'RSS GB':>7} {'sum GB':>7} "
            f"{'mesh':>9} "
            f"{'status':>8} {'gap':>8} {'step ms':>8} {'mem GB':>7} {'recomp':>6}  baselines (step ms, modelled)")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<15} {r['devices']:>5} {'':>5} {r.get('wall_s', ''):>7}  error: {r['error']}")
            continue
        base = ", ".join(f"{k} {_ms(v)}" + (f" ({r['checkpointed'][k]} ckpt)" if k in r["checkpointed"] else "")
                         for k, v in r["baselines"].items())
        lines.append(f"{r['case']:<15} {r['devices']:>5} {r['global_batch']:>5} {r['wall_s']:>7.1f} "
                     f"{r.get('second_wall_s', float('nan')):>7.1f} {r['peak_rss_gb']:>7.2f} "
                     f"{r['peak_rss_sum_gb']:>7.2f} {r['mesh']:>9} "
                     f"{r['status']:>8} {_gap(r['gap']):>8} {_ms(r['step_s']):>8} {r['memory_gb']:>7.1f} "
                     f"{r['recomputed']:>6}  {base}")
    return "\n".join(lines)


def weak_scaling(rows: list[dict]) -> str:
    """Modelled tokens/s/GPU = global batch x sequence / step time / devices, soybean's plan and the best
    baseline that fits, beside torchtitan's published measurement where one exists."""
    head = f"{'model':<14} {'GPUs':>5} {'soybean':>9} {'best baseline':>22}  torchtitan (measured, bf16)"
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.get("family") or "error" in r:
            continue
        model = r["family"]
        tok = r["global_batch"] * r["seq"] / r["devices"]
        fits = {k: v for k, v in r["baselines"].items() if isinstance(v, float)}
        best = min(fits.items(), key=lambda kv: kv[1]) if fits else None
        base = f"{tok / best[1]:,.0f} ({best[0]})" if best else "none fits"
        lines.append(f"{model:<14} {r['devices']:>5} {tok / r['step_s']:>9,.0f} {base:>22}  "
                     f"{TORCHTITAN.get((model, r['devices']), '-')}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(c.name for c in CASES),
                    help="comma-separated case names (default: all): " + ", ".join(c.name for c in CASES))
    ap.add_argument("--time-limit", type=float, default=60.0, help="soybean plan --time-limit per solve")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up on a case after this many seconds")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--jobs", type=int, default=None, help="soybean plan --jobs (default: soybean's choice)")
    a = ap.parse_args()
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in a.cases.split(",") if n not in by_name]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}: use {', '.join(by_name)}")
    rows = []
    cache = tempfile.mkdtemp(prefix="soybean-bench-cache-")
    for name in a.cases.split(","):
        rows.append(run(by_name[name], a.time_limit, a.timeout, cache, a.jobs))
        if not a.json:
            print(f"{name}: {rows[-1].get('wall_s', '-')} s", file=sys.stderr)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(table(rows))
    print()
    print("Modelled weak scaling, tokens/s/GPU (h100 profiles; the cluster cases bf16-mixed, recompute auto):")
    print(weak_scaling(rows))


if __name__ == "__main__":
    main()
