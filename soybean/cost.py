"""Cost model: bytes and seconds of collectives, compute and memory.

Ring collectives on a group of ``p`` devices, message of ``m`` bytes
(``m`` = the full result for all-gather, the full input for reduce-scatter,
the local buffer for all-reduce and all-to-all):

==============  =======================  ===========================
collective      bytes sent per device    time
==============  =======================  ===========================
all_reduce      2 (p-1)/p * m            2 (p-1) alpha + bytes beta
all_gather      (p-1)/p * m              (p-1) alpha + bytes beta
reduce_scatter  (p-1)/p * m              (p-1) alpha + bytes beta
all_to_all      (p-1)/p * m              (p-1) alpha + bytes beta
==============  =======================  ===========================

Each forward step has a backward (its adjoint, see ``reshard``) that is priced
too when the tensor needs a gradient: training comm per step = forward + backward.
Compute: a training step is about 3x the forward FLOPs (backward ~ 2x forward);
an op's work is divided by the product of the mesh axes its strategy splits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from .mesh import Mesh
from .profiles import Profile
from .reshard import apply_step, plan_reshard
from .tiling import max_local_numel

RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
# The adjoint of each forward step, as the collective that runs in backward (None: free).
BACKWARD = {
    "all_gather": None,  # slice; reduce_scatter when grad_partial (handled below)
    "shard": "all_gather", "all_reduce": None, "reduce_scatter": "all_gather",
    "all_to_all": "all_to_all", "to_partial": None, "grad_all_reduce": "all_reduce", "grad_to_partial": None,
}


@dataclass(frozen=True)
class Cost:
    bytes: float = 0.0
    seconds: float = 0.0

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.bytes + o.bytes, self.seconds + o.seconds)


def collective(kind: str, m: float, p: int, alpha: float, beta: float) -> Cost:
    """Ring cost of one collective of message ``m`` bytes on ``p`` devices."""
    if p <= 1 or kind not in RING_FACTOR:
        return Cost()
    f = RING_FACTOR[kind]
    sent = f * (p - 1) / p * m
    return Cost(sent, f * (p - 1) * alpha + sent * beta)


@lru_cache(maxsize=200_000)
def _collectives(src: tuple, dst: tuple, partial_grad_axes: tuple, src_partial_axes: tuple, needs_grad: bool) -> tuple[tuple[str, int, tuple], ...]:
    """Shape-free: the (collective, mesh axis, tiling whose tile size is ``m``) of every forward
    and backward step of ``src -> dst``; one table serves every tensor shape."""
    steps = plan_reshard(src, dst, partial_grad_axes, src_partial_axes) if needs_grad else plan_reshard(src, dst)
    out: list[tuple[str, int, tuple]] = []
    cur = src
    for step in steps:
        nxt = apply_step(cur, step)
        m_tiling = nxt if step.kind == "all_gather" else cur
        if not step.kind.startswith("grad_") and step.kind in RING_FACTOR:
            out.append((step.kind, step.axis, m_tiling))
        if needs_grad:
            bwd = "reduce_scatter" if step.kind == "all_gather" and step.grad_partial else BACKWARD[step.kind]
            if bwd is not None:
                # a backward all_gather rebuilds the gradient of the tensor before the step
                out.append((bwd, step.axis, cur if bwd == "all_gather" else m_tiling))
        cur = nxt
    return tuple(out)


@lru_cache(maxsize=400_000)
def reshard_cost(src: tuple, dst: tuple, shape: tuple, itemsize: int, mesh: Mesh, profile: Profile, partial_grad_axes: tuple, needs_grad: bool, src_partial_axes: tuple = ()) -> Cost:
    """Forward + backward cost of turning ``src`` into ``dst`` for one tensor."""
    nb = ns = 0.0
    for kind, axis, tiling in _collectives(src, dst, tuple(partial_grad_axes), tuple(src_partial_axes), needs_grad):
        a, b = profile.ab(axis, kind)
        c = collective(kind, float(max_local_numel(shape, tiling, mesh) * itemsize), mesh.shape[axis], a, b)
        nb += c.bytes
        ns += c.seconds
    return Cost(nb, ns)


def compute_seconds(flops: float, bytes_moved: float, work_fraction: float, profile: Profile) -> float:
    """Roofline time of one training step of an op (forward + backward = 3x forward)."""
    return 3.0 * work_fraction * max(flops / profile.flops, bytes_moved / profile.mem_bw)


def work_fraction(split_axes: Sequence[bool], mesh: Mesh) -> float:
    return 1.0 / math.prod(p for p, s in zip(mesh.shape, split_axes) if s) if any(split_axes) else 1.0
