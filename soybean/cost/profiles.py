"""Machine profiles: what the cost model knows about a machine.

Each mesh axis has a latency ``alpha`` (s per message hop) and an inverse
bandwidth ``beta`` (s per byte sent by one device).  Compute runs at ``flops``
(FLOP/s, matmul-like ops) and ``mem_bw`` (bytes/s, elementwise ops).
``grad_overlap`` is the fraction of an asynchronous gradient all-reduce that
runs hidden behind concurrent backward compute (0: none, 1: all of it).
``soybean calibrate`` writes a JSON profile measured on the current machine.

Topology: a cluster is nodes of ``gpus_per_node`` devices.  Ranks fill nodes in order and mesh
coordinates are row-major, so the group of mesh axis ``k`` is ``p_k`` ranks ``prod_{j>k} p_j`` apart;
it stays inside a node when every group's ranks share ``rank // gpus_per_node``.  A ring on an axis
whose groups cross nodes runs at the slower link: ``node_alpha``/``node_beta``
(``Profile.on_mesh`` marks those axes in ``inter_node``).  Trying every mesh shape (2x8 and 8x2 alike)
tries every assignment of axes to the two levels.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import overload

import numpy as np

from ..mesh import Mesh

# glibc's largest mmap threshold: blocks this big are mapped afresh, and page-faulted in, on every
# allocation (the CPU profiles' ``large_alloc``).
LARGE_ALLOC = 32 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    alpha: float          # seconds per ring step
    beta: float           # seconds per byte sent per device
    flops: float          # FLOP/s per device, dense matmul/conv
    mem_bw: float         # bytes/s per device, elementwise/memory-bound ops
    memory_gb: float      # device memory
    axis_alpha: tuple[float, ...] = field(default=())   # optional per-axis overrides (outer axis first)
    axis_beta: tuple[float, ...] = field(default=())
    conv_flops: float = 0.0                              # convolution FLOP/s; 0: same as ``flops``
    fp32_flops: float = 0.0                              # FLOP/s of a float32 op other than a convolution; 0: ``flops``
    # measured (kind, alpha, beta); kind "all_reduce" is the backend's call, "all_reduce:lp" soybean's lp algorithm
    # (``runtime.algorithms``), "p2p" one point-to-point round of any of soybean's algorithms
    collectives: tuple[tuple[str, float, float], ...] = field(default=())
    optimizer_bw: float = 0.0                            # parameter bytes/s an AdamW step gets through; 0: mem_bw / 7
    optimizer_large_bw: float = 0.0                      # the same for a tile of at least large_alloc; 0: from alloc_bw
    optimizer_tensor_s: float = 0.0                      # fixed AdamW seconds per parameter tensor (per-tensor kernels)
    grad_overlap: float = 0.0                            # share of async gradient all-reduce time hidden by compute
    large_alloc: float = 0.0                             # bytes from which a new tensor is page-faulted in; 0: never
    alloc_bw: float = 0.0                                # bytes/s of first-touching such a tensor
    blocking_s: float = 0.0                              # extra seconds of each blocking collective amid compute
    op_s: float = 0.0                                    # fixed seconds of each pass of an op (dispatch, autograd)
    optimizer_foreach: bool = False                      # AdamW takes its multi-tensor path (CUDA's default)
    # mixture of experts: the busiest rank's routed rows over the balanced share (the workload's routing, set by
    # ``--expert-imbalance``): scales routed experts' all-to-alls and their compute where the experts are split
    expert_imbalance: float = 1.0
    node_alpha: float = 0.0                              # seconds per ring step across nodes; 0: no second level
    node_beta: float = 0.0                               # seconds per byte per device across nodes
    inter_node: tuple[bool, ...] = field(default=())     # per mesh axis: do its groups cross nodes (``on_mesh``)
    # the collective algorithms the planner may pick from (``ir.algorithms.ALGORITHMS``); empty: every one
    algorithms: tuple[str, ...] = field(default=())
    # measured beta against message size for a ``collectives`` key: (key, ((m, beta), ...)), m ascending (the kinds
    # table's message).  One alpha-beta line cannot follow a bandwidth that changes with the message (caches,
    # protocols: NCCL's tuner keeps one per protocol for this); ``ab`` interpolates beta in log m between them.
    beta_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = field(default=())

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:  # the pricing caches hash the profile on every lookup: compute it once
        return self._hash

    def __getstate__(self) -> dict:
        # The cached hash is this process's (string hashing is salted per process): never pickle it.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @overload
    def ab(self, axis: int, kind: str = "", algorithm: str = "backend", m: None | float = None) -> tuple[float, float]:
        ...

    @overload
    def ab(self, axis: int, kind: str, algorithm: str, m: np.ndarray) -> tuple[float, np.ndarray]:
        ...

    def ab(self, axis: int, kind: str = "", algorithm: str = "backend",
           m: float | np.ndarray | None = None) -> tuple[float, float | np.ndarray]:
        """alpha, beta for a collective of ``kind`` run by ``algorithm`` on mesh ``axis``: the inter-node link
        for an axis whose groups cross nodes, else a per-axis override, else the calibrated figure for that
        collective and algorithm (for one of soybean's algorithms: ``kind:algorithm``, else ``p2p``; for the
        backend's: ``kind``), else the profile's default.  Given the message ``m`` (the kinds table's; an array
        gives an array of betas), a calibrated figure's beta is its ``beta_curves`` entry at ``m``."""
        a, b = self.alpha, self.beta
        found = ""
        keys = (kind,) if algorithm == "backend" else ("p2p", f"{kind}:{algorithm}")  # the more specific last
        for key in keys:
            for k, ka, kb in self.collectives:
                if k == key:
                    a, b, found = ka, kb, k
        if axis < len(self.inter_node) and self.inter_node[axis] and self.node_beta:
            # across nodes, the link's figures; one of soybean's rounds takes at least its own latency
            return (self.node_alpha if algorithm == "backend" else max(self.node_alpha, a)), self.node_beta
        a = self.axis_alpha[axis] if axis < len(self.axis_alpha) else a
        if axis < len(self.axis_beta):
            return a, self.axis_beta[axis]
        if m is not None and found:
            for k, points in self.beta_curves:
                if k == found:
                    return a, _interp_log(m, points)
        return a, b

    def on_mesh(self, mesh: Mesh, gpus_per_node: int | None) -> Profile:
        """This profile with the axes of ``mesh`` whose groups cross nodes of ``gpus_per_node`` marked."""
        if not gpus_per_node or gpus_per_node >= mesh.size:
            return replace(self, inter_node=())
        node = np.arange(mesh.size).reshape(mesh.shape) // gpus_per_node  # each rank's node
        crosses = tuple(bool((node.max(axis=axis) != node.min(axis=axis)).any()) for axis in range(mesh.ndim))
        return replace(self, inter_node=crosses)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


BUILTIN: dict[str, Profile] = {
    # This machine: 2 CPU cores, gloo over loopback, one thread per process (`soybean calibrate`,
    # several runs, rounded): collectives as the runtime runs them ~0.2 ms per ring step and
    # ~1.8 GB/s; fp32 matmul ~110 GFLOP/s; elementwise ops on activation-sized tensors ~20 GB/s;
    # a fresh allocation of 32 MiB or more is page-faulted in at ~2.5 GB/s; AdamW ~1 GB/s of
    # parameter bytes (~0.45 GB/s on a 32 MiB tile, its temporaries page-faulted in) plus ~0.2 ms
    # per parameter tensor (torch's CPU AdamW runs a dozen small kernels per tensor); 0-35% of an
    # async all_reduce hides behind a matmul loop (gloo needs CPU too); a blocking collective between
    # two stretches of compute costs ~0.45-0.65 ms more than the same collective timed right after a
    # barrier.  One round of soybean's own collective algorithms (``runtime.algorithms``: batched isend/irecv
    # from Python) takes ~0.25 ms and moves ~1.6 GB/s per process (``p2p``, two calibrate runs, rounded).
    # Each pass of an op, forward or backward, costs ~4 us before any arithmetic: the dispatcher, the autograd
    # node, the allocation (a chain of tiny ops trained, ``calibrate``: 3.3 us forward with autograd, 7.7 us both).
    "cpu-gloo": Profile("cpu-gloo", alpha=2e-4, beta=1 / 1.8e9, flops=1.1e11, mem_bw=2e10, memory_gb=12.0,
                        conv_flops=1.0e11, optimizer_bw=1.0e9, optimizer_large_bw=0.45e9, optimizer_tensor_s=2e-4,
                        grad_overlap=0.25, large_alloc=float(LARGE_ALLOC), alloc_bw=2.5e9, blocking_s=5e-4, op_s=4e-6,
                        collectives=(("p2p", 2.5e-4, 1 / 1.6e9),)),
    # 8x H100 SXM with NVLink 4 / NVSwitch: 450 GB/s per direction per GPU, NCCL reaches ~360 GB/s
    # bus bandwidth on large all-reduces; ~5 us per ring step (NVIDIA H100 datasheet; NCCL tests).  NCCL runs on its
    # own stream, so bucketed gradient all-reduces mostly hide behind backward (all but the last bucket).
    # A round of soybean's own algorithms is a Python-issued batch of NCCL send/recv: assumed 20 us (not measured:
    # one GPU lent here; NCCL's sendrecv launch is ~5-10 us, nccl-tests) at NCCL's link bandwidth.  No fixed cost per
    # op (``op_s`` 0): kernels are queued asynchronously, so the host's few microseconds per op hide behind the
    # device's work on the layers planned here (a model too small for that is launch-bound: CUDA graphs' case).
    # Compute, measured on one H100 80GB HBM3 (``scripts/time_ops_cuda.py``, torch 2.11, 2026-11-27, median of 10
    # CUDA-event timings): bf16 matmuls at one device's share of Llama-3-8B at 2 x 8,192 tokens ran at 725-761
    # TFLOP/s whole (q/o 753, MLP up 761, down 726, an eighth of the LM head 752) and 575-645 split 8 ways as
    # tensor parallelism splits them (k/v 655): ``flops`` 650e12 (the datasheet's 989 dense at ~2/3).  float32
    # matmuls (torch's default: no TF32) ran at 50-52 TFLOP/s: ``fp32_flops`` 50e12, 13x slower, where a single rate
    # priced them 8x too fast.  Causal attention (flash, 2 x 32 x 8,192 x 128) ran in 1.78 ms forward, 3.28 without
    # the mask: the kernels skip the masked half (``rules.attention.sdpa_flops``); its backward took 3.0-3.2
    # forwards.  Elementwise ops on activations moved 2.8-3.0 TB/s: ``mem_bw`` 2.9e12 (datasheet 3.35).  torch's
    # AdamW (multi-tensor, its CUDA default) stepped a layer's 832 MiB of float32 weights in 6.85 ms: ``optimizer_bw``
    # 125e9 parameter bytes/s, a quarter of the 7 memory passes at ``mem_bw`` that an unmeasured profile assumes.
    # AdamW on CUDA takes torch's multi-tensor path (``optimizer_foreach``): its temporaries span every parameter.
    # Whole steps (``scripts/check_cuda.py``, world size 1, same H100, 2026-11-27; modelled under the figures
    # before these): a GPT-2-shaped decoder in bf16, batch 8 x 1,024, 20.8 ms a step (16.6 on an H200, 2026-11-26)
    # against 15.2 modelled, peak 3,189 MiB against 2,945; transformers' Llama (4 layers of 512, batch 4 x 512, loss
    # from ``out.logits``) 21.2 ms against 1.6: at these sizes a step is the host's ~13 us per pass of an op
    # (launch-bound), which ``op_s`` 0 leaves out.
    "h100-nvlink": Profile("h100-nvlink", alpha=5e-6, beta=1 / 360e9, flops=650e12, mem_bw=2.9e12, memory_gb=80.0,
                           fp32_flops=50e12, optimizer_bw=125e9, grad_overlap=0.8,
                           collectives=(("p2p", 20e-6, 1 / 360e9),), optimizer_foreach=True),
    # Nodes of 8x H100 SXM as above (NVLink inside a node), joined by 400 Gb/s InfiniBand NDR per GPU: one
    # ConnectX-7 per GPU, 50 GB/s per direction, of which NCCL's ring reaches ~45 GB/s bus bandwidth across
    # nodes; ~15 us per ring step across the network.  (NVIDIA DGX H100 user guide: 8x ConnectX-7
    # 400 Gb/s; NCCL tests on DGX H100 clusters.)  Use with --gpus-per-node 8.
    "h100-nvlink-ib": Profile("h100-nvlink-ib", alpha=5e-6, beta=1 / 360e9, flops=650e12, mem_bw=2.9e12,
                              memory_gb=80.0, fp32_flops=50e12, optimizer_bw=125e9, grad_overlap=0.8,
                              node_alpha=15e-6, node_beta=1 / 45e9,
                              collectives=(("p2p", 20e-6, 1 / 360e9),), optimizer_foreach=True),
}


def _interp_log(m: float | np.ndarray, points: tuple[tuple[float, float], ...]) -> float | np.ndarray:
    """Beta at message ``m``: linear in log m between the measured points, the end points' beyond them."""
    xs = np.log([max(p[0], 1.0) for p in points])
    out = np.interp(np.log(np.maximum(m, 1.0)), xs, [p[1] for p in points])
    return float(out) if np.ndim(m) == 0 else out


def load_profile(name_or_path: str | None) -> Profile:
    """A built-in profile by name, or a JSON file written by ``soybean calibrate``."""
    if name_or_path is None:
        return BUILTIN["cpu-gloo"]
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        d = json.loads(p.read_text())
        d["axis_alpha"] = tuple(d.get("axis_alpha", ()))
        d["axis_beta"] = tuple(d.get("axis_beta", ()))
        d["collectives"] = tuple(tuple(x) for x in d.get("collectives", ()))
        d["inter_node"] = tuple(d.get("inter_node", ()))
        d["algorithms"] = tuple(d.get("algorithms", ()))
        d["beta_curves"] = tuple((k, tuple(tuple(p) for p in pts)) for k, pts in d.get("beta_curves", ()))
        known = set(Profile.__dataclass_fields__)
        return Profile(**{k: v for k, v in d.items() if k in known})  # e.g. calibrate's raw "measurements"
    raise ValueError(f"unknown profile {name_or_path!r}: use one of {', '.join(sorted(BUILTIN))} "
                     "or a JSON file from `soybean calibrate`")
