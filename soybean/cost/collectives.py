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

Each forward step has a backward (its adjoint, see ``runtime.kinds``) that is priced
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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..mesh import Mesh
from ..reshard import Route
from ..runtime.kinds import KINDS, RING_FACTOR, apply_step
from ..tiling import max_local_numel
from .profiles import Profile


@dataclass(frozen=True)
class Cost:
    bytes: float = 0.0
    seconds: float = 0.0
    sync_seconds: float = 0.0  # the part of ``seconds`` that gradient all-reduces take

    def __add__(self, o: Cost) -> Cost:
        return Cost(self.bytes + o.bytes, self.seconds + o.seconds, self.sync_seconds + o.sync_seconds)


def collective(kind: str, m: float, p: int, alpha: float, beta: float) -> Cost:
    """Ring cost of one collective of message ``m`` bytes on ``p`` devices."""
    if p <= 1 or kind not in RING_FACTOR:
        return Cost()
    f = RING_FACTOR[kind]
    sent = f * (p - 1) / p * m
    return Cost(sent, f * (p - 1) * alpha + sent * beta)


@lru_cache(maxsize=200_000)
def priced_steps(route: Route) -> tuple[tuple[str, int, tuple, bool], ...]:
    """Shape-free: the (collective, mesh axis, tiling whose local tile is the message ``m``, is the
    gradient sync) of every forward and backward collective of ``route``, read from the kinds
    table; one table serves every tensor shape."""
    out: list[tuple[str, int, tuple, bool]] = []
    cur = route.src
    for step in route.steps():
        kind = KINDS[step.kind]
        nxt = apply_step(cur, step)
        priced = [(kind.forward, False)] + ([(kind.adjoint(step), kind.gradient_sync)] if route.needs_grad else [])
        for c, sync in priced:
            if c is not None:
                out.append((c.collective, step.axis, nxt if c.message == "after" else cur, sync))
        cur = nxt
    return tuple(out)


@lru_cache(maxsize=400_000)
def reshard_cost(route: Route, shape: tuple, itemsize: int, mesh: Mesh, profile: Profile) -> Cost:
    """Forward + backward cost of ``route`` for one tensor of ``shape``."""
    nb = ns = sync = 0.0
    for kind, axis, tiling, is_sync in priced_steps(route):
        a, b = profile.ab(axis, kind)
        c = collective(kind, float(max_local_numel(shape, tiling, mesh) * itemsize), mesh.shape[axis], a, b)
        blocking = profile.blocking_s if not is_sync and mesh.shape[axis] > 1 else 0.0
        nb += c.bytes
        ns += c.seconds + blocking
        sync += c.seconds if is_sync else 0.0
    return Cost(nb, ns, sync)


def price_routes(routes: Sequence[Route], shape: tuple, itemsize: int, mesh: Mesh,
                 profile: Profile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``reshard_cost`` of many routes of one tensor at once: arrays of bytes, seconds and sync seconds.

    The same sums term by term, as numpy arithmetic over every collective of every route: a table of
    a Llama layer's edge on a 2x2x2 mesh prices ~450 routes and ~1,600 collectives, and a Python loop
    over them was most of the build.  The tile size is computed once per distinct tiling, ``alpha`` and
    ``beta`` once per (axis, collective); the figures equal ``reshard_cost``'s bit for bit (the tests
    compare them).
    """
    n = len(routes)
    owner: list[int] = []
    kinds: list[str] = []
    axes: list[int] = []
    tilings: list[tuple] = []
    syncs: list[bool] = []
    for r, route in enumerate(routes):
        for kind, axis, tiling, is_sync in priced_steps(route):
            owner.append(r)
            kinds.append(kind)
            axes.append(axis)
            tilings.append(tiling)
            syncs.append(is_sync)
    if not owner:
        return np.zeros(n), np.zeros(n), np.zeros(n)
    tile_of: dict[tuple, int] = {}
    t_idx = np.array([tile_of.setdefault(t, len(tile_of)) for t in tilings], dtype=np.int64)
    m = np.array([float(max_local_numel(shape, t, mesh) * itemsize) for t in tile_of])[t_idx]
    link_of: dict[tuple[int, str], int] = {}
    l_idx = np.array([link_of.setdefault(ak, len(link_of)) for ak in zip(axes, kinds)], dtype=np.int64)
    links = [profile.ab(axis, kind) for axis, kind in link_of]
    alpha = np.array([a for a, _ in links])[l_idx]
    beta = np.array([b for _, b in links])[l_idx]
    p = np.array([mesh.shape[a] for a in axes], dtype=float)
    f = np.array([RING_FACTOR.get(k, 0.0) for k in kinds])
    on = p > 1  # ``collective``: nothing on a group of one, or for a kind with no ring factor
    sent = np.where(on, f * (p - 1) / p * m, 0.0)
    seconds = np.where(on, f * (p - 1) * alpha + sent * beta, 0.0)
    sync = np.array(syncs)
    blocking = np.where(~sync & on, profile.blocking_s, 0.0)
    own = np.array(owner, dtype=np.int64)
    return (np.bincount(own, sent, minlength=n), np.bincount(own, seconds + blocking, minlength=n),
            np.bincount(own, np.where(sync, seconds, 0.0), minlength=n))
