"""Collectives: bytes and seconds of the reshard steps of one tensor, forward and backward.

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
A blocking collective (every one but the asynchronous gradient all-reduce) also costs the
profile's ``blocking_s``: inside a program the ranks reach it after compute rather than
aligned by a barrier, and the one that arrives first waits (on the CPU box ~0.5 ms, as much
again as a small all-reduce's own latency; ``calibrate`` measures it).
The all-reduce of a ``grad_all_reduce`` step is also reported apart
(``Cost.sync_seconds``): on a parameter's own edge the runtime defers it to the
bucketed, asynchronous gradient sync, which overlaps the rest of backward (see
``planner.evaluate`` for how much of it is hidden).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..mesh import Mesh
from .profiles import Profile
from ..reshard import apply_step, plan_reshard
from ..tiling import max_local_numel

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
    sync_seconds: float = 0.0  # the part of ``seconds`` that gradient all-reduces take

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.bytes + o.bytes, self.seconds + o.seconds, self.sync_seconds + o.sync_seconds)


def collective(kind: str, m: float, p: int, alpha: float, beta: float) -> Cost:
    """Ring cost of one collective of message ``m`` bytes on ``p`` devices."""
    if p <= 1 or kind not in RING_FACTOR:
        return Cost()
    f = RING_FACTOR[kind]
    sent = f * (p - 1) / p * m
    return Cost(sent, f * (p - 1) * alpha + sent * beta)


@lru_cache(maxsize=200_000)
def _collectives(src: tuple, dst: tuple, partial_grad_axes: tuple, src_partial_axes: tuple, needs_grad: bool) -> tuple[tuple[str, int, tuple, bool], ...]:
    """Shape-free: the (collective, mesh axis, tiling whose tile size is ``m``, is a gradient
    all-reduce) of every forward and backward step of ``src -> dst``; one table serves every
    tensor shape."""
    steps = plan_reshard(src, dst, partial_grad_axes, src_partial_axes) if needs_grad else plan_reshard(src, dst)
    out: list[tuple[str, int, tuple, bool]] = []
    cur = src
    for step in steps:
        nxt = apply_step(cur, step)
        m_tiling = nxt if step.kind == "all_gather" else cur
        if not step.kind.startswith("grad_") and step.kind in RING_FACTOR:
            out.append((step.kind, step.axis, m_tiling, False))
        if needs_grad:
            bwd = "reduce_scatter" if step.kind == "all_gather" and step.grad_partial else BACKWARD[step.kind]
            if bwd is not None:
                # a backward all_gather rebuilds the gradient of the tensor before the step
                out.append((bwd, step.axis, cur if bwd == "all_gather" else m_tiling, step.kind == "grad_all_reduce"))
        cur = nxt
    return tuple(out)


@lru_cache(maxsize=400_000)
def reshard_cost(src: tuple, dst: tuple, shape: tuple, itemsize: int, mesh: Mesh, profile: Profile, partial_grad_axes: tuple, needs_grad: bool, src_partial_axes: tuple = ()) -> Cost:
    """Forward + backward cost of turning ``src`` into ``dst`` for one tensor."""
    nb = ns = sync = 0.0
    for kind, axis, tiling, is_sync in _collectives(src, dst, tuple(partial_grad_axes), tuple(src_partial_axes), needs_grad):
        a, b = profile.ab(axis, kind)
        c = collective(kind, float(max_local_numel(shape, tiling, mesh) * itemsize), mesh.shape[axis], a, b)
        blocking = profile.blocking_s if not is_sync and mesh.shape[axis] > 1 else 0.0
        nb += c.bytes
        ns += c.seconds + blocking
        sync += c.seconds if is_sync else 0.0
    return Cost(nb, ns, sync)
