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

Each collective of a reshard step runs the algorithm (``runtime.algorithms``: the backend's own, or
soybean's ``lp``, ``ring``, ``tree`` on point-to-point rounds) that ``choose`` finds cheapest for its
collective, group and message among the profile's allowed ones (``Profile.algorithms``), each priced by its
own rounds and bytes with its own calibrated ``alpha``, ``beta`` (``Profile.ab``); the table above is the
backend's.  The gradient sync and the communication inside ops stay the backend's (the sync is
asynchronous, bucketed, and overlaps backward).

Communication inside an op is priced apart, by ``op_comm_costs``.  A windowed op's halo exchange
(``rules.window``, ``op_comm_calls``): member ``k`` receives the rows of its window that other members
own, ``h`` rows of ``r`` bytes at most, in one message from each of at most ``n`` owners, so forward
takes ``n alpha + h r beta`` (+ ``blocking_s``); its adjoint (the halo gradients sent back to their
owners, ``h`` and ``n`` counted for the busiest receiver alike) is priced too when the input needs a
gradient.  Batch norm split along batch or space sums its statistics: one all-reduce each way (its rule's ``comm``).

Each forward step has a backward (its adjoint, see ``ir.kinds``) that is priced
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

import numpy as np

from ..ir import algorithms as A
from ..ir.kinds import RING_FACTOR, Step
from ..mesh import Mesh
from ..reshard import Route, walk_step
from ..rules.base import OpCall, OpSpec, Strategy, lookup
from ..rules.window import halos, windows_of
from ..tiling import R, max_local_numel
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


def backend_call(kind: str, m: float, p: int, axis: int, profile: Profile) -> Cost:
    """``collective`` with the profile's alpha and beta for the backend's own call on mesh ``axis`` (beta at this
    message: ``Profile.ab``)."""
    return collective(kind, m, p, *profile.ab(axis, kind, A.BACKEND, m))


@dataclass(frozen=True)
class Choice:
    """The algorithm a collective runs (``lp``: with ``chunks`` chunks), the bytes the busiest member sends
    and its seconds (without ``blocking_s``)."""

    algorithm: str = A.BACKEND
    chunks: int = 1
    bytes: float = 0.0
    seconds: float = 0.0


def allowed(profile: Profile, kind: str, sync: bool = False) -> tuple[str, ...]:
    """The algorithms a ``kind`` collective may run: the profile's (every one when it names none) for the five
    that ``runtime.algorithms`` implements, the backend's for any other and for the gradient sync."""
    if sync or kind not in A.COLLECTIVES:
        return (A.BACKEND,)
    return profile.algorithms or A.ALGORITHMS


def choose(kind: str, m: float, p: int, axis: int, profile: Profile, sync: bool = False) -> Choice:
    """The cheapest allowed algorithm for a ``kind`` collective of ``m`` bytes on mesh ``axis`` (``p`` members):
    ``rounds alpha + bytes beta`` (``ir.algorithms.terms``) with the algorithm's own ``alpha``, ``beta``;
    ties go to the earlier of ``ALGORITHMS`` (the backend first)."""
    if p <= 1 or kind not in RING_FACTOR and kind not in A.COLLECTIVES:
        return Choice()
    if kind not in A.COLLECTIVES:  # all_to_all: the backend's ring formula
        c = backend_call(kind, m, p, axis, profile)
        return Choice(A.BACKEND, 1, c.bytes, c.seconds)
    best: Choice | None = None
    for name in allowed(profile, kind, sync):
        a, b = profile.ab(axis, kind, name, m)
        k = int(A.lp_chunks(kind, m, p, a, b)) if name == "lp" else 1
        rounds, sent = A.terms(kind, name, m, p, k)
        seconds = float(rounds * a + sent * b)
        if best is None or seconds < best.seconds:
            best = Choice(name, k, float(sent), seconds)
    assert best is not None
    return best


@dataclass(frozen=True)
class Call:
    """One collective a reshard step runs: forward, or its adjoint in backward."""

    step: Step
    collective: str
    backward: bool
    m: float          # message bytes (module docstring)
    sync: bool        # the gradient sync (the backend's, deferred on a parameter's own edge)


def route_calls(route: Route, shape: tuple, itemsize: int, mesh: Mesh) -> list[Call]:
    """Every collective ``route``'s steps run on a group of more than one, forward and (when the value needs a
    gradient) backward, in step order (``Route.walk``): what ``reshard_cost`` prices and a generated program
    calls."""
    return [Call(w.step, c.collective, c.backward, float(max_local_numel(shape, c.message, mesh) * itemsize), c.sync)
            for w in route.walk() for c in w.calls if mesh.shape[w.step.axis] > 1]


def priced_steps(route: Route) -> tuple[tuple[str, int, tuple, bool], ...]:
    """Shape-free: the (collective, mesh axis, tiling whose local tile is the message ``m``, is the
    gradient sync) of every forward and backward collective of ``route`` (``Route.walk``); one table serves
    every tensor shape."""
    return tuple((c.collective, w.step.axis, c.message, c.sync) for w in route.walk() for c in w.calls)


def reshard_cost(route: Route, shape: tuple, itemsize: int, mesh: Mesh, profile: Profile) -> Cost:
    """Forward + backward cost of ``route`` for one tensor of ``shape``: the definition, one route at a time, uncached
    (the tests compare against it); a planner run prices many routes at once and keeps them in its own
    ``cost.pricing.PricingCache`` (``price_routes``, equal bit for bit)."""
    nb = ns = sync = 0.0
    for kind, axis, tiling, is_sync in priced_steps(route):
        c = choose(kind, float(max_local_numel(shape, tiling, mesh) * itemsize), mesh.shape[axis], axis, profile,
                   is_sync)
        blocking = profile.blocking_s if not is_sync and mesh.shape[axis] > 1 else 0.0
        nb += c.bytes
        ns += c.seconds + blocking
        sync += c.seconds if is_sync else 0.0
    return Cost(nb, ns, sync)


def op_comm_calls(op: OpSpec, st: Strategy, grads: Sequence[bool], mesh: Mesh, imbalance: float = 1.0,
                  rerun: bool = False) -> list[OpCall]:
    """``_op_comm_calls`` (below); ``rerun``: the op's layer is recomputed, so its forward calls run once more, in
    backward, before its own backward ones."""
    calls = _op_comm_calls(op, st, grads, mesh, imbalance)
    if not rerun:
        return calls
    fwd = _op_comm_calls(op, st, [False] * len(grads), mesh, imbalance)
    return fwd + calls if fwd else calls


def _op_comm_calls(op: OpSpec, st: Strategy, grads: Sequence[bool], mesh: Mesh, imbalance: float = 1.0
                   ) -> list[OpCall]:
    """The ``OpCall`` (collective, mesh axis, message bytes, messages, compute behind it) of every call the
    communication inside ``op`` makes
    under ``st`` in one training step, in program order (module docstring):

    * a halo exchange along each windowed dim the strategy splits: the busiest member's received rows
      (``Window.halo_rows``) times the row's bytes, from ``Window.sources`` members; backward (when the input
      needs a gradient) the rows' gradients go back.  The exchanges run one after another, each on the
      rows the ones before it grew (the longest window along their dims);
    * for an op whose rule lists its own collectives (``comm``: batch norm's statistics, routed experts' all-to-alls,
      the busiest rank's at ``imbalance`` times the balanced rows, attention's moves and ring passes, a class-split
      loss's statistics), those.
    """
    out: list[OpCall] = []
    grown: dict[int, tuple[list[int], list]] = {}  # input slot -> (shape, tiling) as the halos grow it
    for axis, w in halos(windows_of(op), st):
        p = mesh.shape[axis]
        spec = op.inputs[w.slot]
        shape, tiling = grown.setdefault(w.slot, (list(spec.shape), list(st.inputs[w.slot])))
        shape[w.dim] = 1
        tiling[axis] = R  # the split axis' rows are counted by the window
        row = float(max_local_numel(tuple(shape), tuple(tiling), mesh) * spec.dtype.itemsize)
        for back in ((False, True) if grads[w.slot] else (False,)):
            h = w.halo_rows(p, back)
            if p > 1 and h:
                out.append(OpCall("halo", axis, h * row, w.sources(p, back)))
        shape[w.dim] = max(e - s for s, e in w.members(p))  # later exchanges carry these rows
    entry = lookup(op.target)
    if entry is not None and entry.comm is not None:
        return out + entry.comm(op, st, list(grads), mesh, imbalance)
    return out


def op_call_cost(call: OpCall, mesh: Mesh, profile: Profile, compute_s: float) -> Cost:
    """One call inside an op: a halo exchange of ``m`` bytes from ``n`` members takes ``n alpha + m beta``, any other
    collective is priced as the backend runs it (``backend_call``); what ``call.behind`` times the op's forward
    compute (``compute_s``: ``cost.compute.op_seconds`` without gradients) hides is taken off, and the wait for it
    blocks (``blocking_s``)."""
    a, b = profile.ab(call.axis, call.kind)
    m = call.bytes
    c = Cost(m, call.messages * a + m * b) if call.kind == "halo" else \
        backend_call(call.kind, m, mesh.shape[call.axis], call.axis, profile)
    return Cost(c.bytes, max(0.0, c.seconds - call.behind * compute_s) + profile.blocking_s)


def has_comm(op: OpSpec) -> bool:
    """May ``op`` communicate inside itself (a windowed op's halos, the calls its rule's ``comm`` lists)?"""
    entry = lookup(op.target)
    return bool(windows_of(op)) or (entry is not None and entry.comm is not None)


def op_comm_costs(op: OpSpec, strategies: Sequence[Strategy], grads: Sequence[bool], mesh: Mesh,
                  profile: Profile, rerun: bool = False, compute: np.ndarray | None = None) -> np.ndarray | None:
    """``[bytes, seconds]`` of the communication inside ``op`` under each strategy (None: it has none): its
    ``op_comm_calls``, each priced by ``op_call_cost`` (``compute``: the op's forward compute under each strategy,
    ``cost.compute.op_seconds`` without gradients, which a call may run behind)."""
    if not has_comm(op):
        return None
    out = np.zeros((len(strategies), 2))
    for i, st in enumerate(strategies):
        behind = float(compute[i]) if compute is not None else 0.0
        for call in op_comm_calls(op, st, grads, mesh, profile.expert_imbalance, rerun):
            c = op_call_cost(call, mesh, profile, behind)
            out[i] += (c.bytes, c.seconds)
    return out


class StepStore:
    """Every route priced so far by one planner run (``cost.pricing.PricingCache``), its collectives
    (``priced_steps``) flattened once: route ``r``'s are rows ``start[r]:start[r] + count[r]``, each row the id of
    a distinct *call* (collective kind, mesh axis, message tiling, whether it is the gradient sync), whose columns
    are ``calls[:, id]``.  Shape-, mesh- and profile-free, so every table, build and mesh shape of the run reads
    the same rows; a table prices each distinct call once (``price_route_ids``)."""

    def __init__(self) -> None:
        self.ids: dict[Route, int] = {}
        self.kinds: dict[str, int] = {}
        self.tilings: dict[tuple, int] = {}
        self.tiling_list: list[tuple] = []
        self.call_ids: dict[tuple[int, int, int, int], int] = {}
        self.calls = np.zeros((4, 0), dtype=np.int64)   # kind, axis, tiling, is_sync of each call id
        self.start = np.zeros(0, dtype=np.int64)
        self.count = np.zeros(0, dtype=np.int64)
        self.row_call = np.zeros(0, dtype=np.int64)
        self.rows = 0
        self.step_rows: dict[tuple[tuple, Step, bool], tuple[tuple[int, ...], tuple]] = {}  # ``_step_rows``

    def lookup(self, routes: Sequence[Route]) -> np.ndarray:
        """The ids of ``routes``, adding the ones not seen yet."""
        ids = self.ids
        new = [r for r in dict.fromkeys(routes) if r not in ids]
        if new:
            self._add(new)
        return np.fromiter((ids[r] for r in routes), dtype=np.int64, count=len(routes))

    def _add(self, routes: list[Route]) -> None:
        starts: list[int] = []
        counts: list[int] = []
        rows: list[int] = []
        row = self.rows
        calls_before = len(self.call_ids)
        first = len(self.start)  # routes adopted from another store (``adopt``) have ids but no key here
        step_rows, ids = self.step_rows, self.ids
        for k, route in enumerate(routes):  # ``priced_steps``' rows, read off the walk directly: each added once
            ids[route] = first + k
            starts.append(row)
            before = len(rows)
            cur, grad = route.src, route.needs_grad
            for step in route.planned():
                # A route's rows are its steps' in turn, and a cold mesh's ~140 thousand routes share a few
                # thousand (tiling, step) pairs: each pair is walked and numbered once, not once per route.
                got = step_rows.get((cur, step, grad))
                if got is None:
                    got = step_rows[(cur, step, grad)] = self._step_rows(cur, step, grad)
                rows += got[0]
                cur = got[1]
            counts.append(len(rows) - before)
            row += len(rows) - before
        self.start = np.concatenate([self.start, np.array(starts, dtype=np.int64)])
        self.count = np.concatenate([self.count, np.array(counts, dtype=np.int64)])
        self._new_calls(calls_before)
        self._append_rows(np.array(rows, dtype=np.int64))

    def _step_rows(self, cur: tuple, step: Step, grad: bool) -> tuple[tuple[int, ...], tuple]:
        """The call ids of one step walked from tiling ``cur`` (``reshard.walk_step``), and the tiling after it."""
        w = walk_step(cur, step, grad)
        out = []
        for c in w.calls:
            t = self.tilings.get(c.message)
            if t is None:
                t = self.tilings[c.message] = len(self.tiling_list)
                self.tiling_list.append(c.message)
            key = (self.kinds.setdefault(c.collective, len(self.kinds)), step.axis, t, int(c.sync))
            out.append(self.call_ids.setdefault(key, len(self.call_ids)))
        return tuple(out), w.after

    def _new_calls(self, before: int) -> None:
        """``calls`` extended by the call ids from ``before`` on."""
        if len(self.call_ids) > before:
            fresh = np.array(list(self.call_ids)[before:], dtype=np.int64).reshape(-1, 4).T
            self.calls = np.concatenate([self.calls, fresh], axis=1)

    def _append_rows(self, rows: np.ndarray) -> None:
        end = self.rows + len(rows)
        if end > len(self.row_call):  # grow by doubling: appends stay linear overall
            grown = np.zeros(max(end, 2 * len(self.row_call)), dtype=np.int64)
            grown[:self.rows] = self.row_call[:self.rows]
            self.row_call = grown
        self.row_call[self.rows:end] = rows
        self.rows = end

    def state(self) -> dict[str, object]:
        """The store as plain data (``adopt`` reads it back): its routes by id, without the ``Route`` keys."""
        return {"kinds": list(self.kinds), "tilings": list(self.tiling_list), "calls": self.calls.copy(),
                "start": self.start.copy(), "count": self.count.copy(), "row_call": self.row_call[:self.rows].copy()}

    def adopt(self, state: dict, routes: np.ndarray) -> np.ndarray:
        """The routes ``routes`` (ids of ``state``, another store's ``state()``) added here with their rows, each
        call renumbered into this store's; their new ids, in order.  They get no ``Route`` key (``lookup`` of the
        same route walks it again: a second id of the same rows, priced alike)."""
        kinds, tilings, call_ids = self.kinds, self.tilings, self.call_ids
        before = len(call_ids)
        kind_of = [kinds.setdefault(k, len(kinds)) for k in state["kinds"]]
        tiling_of = []
        for t in state["tilings"]:
            if (i := tilings.get(t)) is None:
                i = tilings[t] = len(self.tiling_list)
                self.tiling_list.append(t)
            tiling_of.append(i)
        kind, axis, tiling, sync = state["calls"].tolist() if state["calls"].size else ([], [], [], [])
        call_of = np.array([call_ids.setdefault((kind_of[k], a, tiling_of[t], y), len(call_ids))
                            for k, a, t, y in zip(kind, axis, tiling, sync)], dtype=np.int64)
        self._new_calls(before)
        count = state["count"][routes]
        total = int(count.sum())
        first = np.repeat(state["start"][routes] - (np.cumsum(count) - count), count)
        rows = call_of[state["row_call"][first + np.arange(total)]] if total else np.zeros(0, dtype=np.int64)
        ids = np.arange(len(self.start), len(self.start) + len(routes), dtype=np.int64)
        self.start = np.concatenate([self.start, self.rows + np.cumsum(count) - count])
        self.count = np.concatenate([self.count, count])
        self._append_rows(rows)
        return ids


def price_routes(routes: Sequence[Route], shape: tuple, itemsize: int, mesh: Mesh, profile: Profile,
                 steps: StepStore | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``reshard_cost`` of many routes of one tensor at once: arrays of bytes, seconds and sync seconds.

    The same sums term by term, as numpy arithmetic over every collective of every route (a Llama
    layer's edge on a 2x2x2 mesh prices ~450 routes and ~1,600 collectives; a Python loop over them was
    most of the build).  The routes' collectives come flattened from ``steps`` (a fresh ``StepStore`` when
    none is given); each distinct call (kind, axis, message tiling) is priced once, and the tile size computed
    once per distinct tiling, ``alpha`` and ``beta`` once per (axis, collective).  The figures equal
    ``reshard_cost``'s bit for bit (the tests compare them).
    """
    steps = steps if steps is not None else StepStore()
    return price_route_ids(steps.lookup(routes), shape, itemsize, mesh, profile, steps)


def price_route_ids(ids: np.ndarray, shape: tuple, itemsize: int, mesh: Mesh, profile: Profile,
                    steps: StepStore) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``price_routes`` of the routes whose ids ``steps.lookup`` gave (a caller that prices the same routes for
    many shapes or meshes keeps the ids and skips hashing every route again)."""
    n = len(ids)
    cnt = steps.count[ids]
    total = int(cnt.sum())
    if total == 0:
        return np.zeros(n), np.zeros(n), np.zeros(n)
    own = np.repeat(np.arange(n), cnt)
    first = np.repeat(steps.start[ids] - (np.cumsum(cnt) - cnt), cnt)
    used, c_inv = _distinct(steps.row_call[first + np.arange(total)])
    sent, seconds, sync = _price_calls(steps, used, shape, itemsize, mesh, profile)
    return (np.bincount(own, sent[c_inv], minlength=n), np.bincount(own, seconds[c_inv], minlength=n),
            np.bincount(own, sync[c_inv], minlength=n))


def _price_calls(steps: StepStore, used: np.ndarray, shape: tuple, itemsize: int, mesh: Mesh,
                 profile: Profile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes sent, seconds (``blocking_s`` included) and gradient-sync seconds of the calls ``used`` of a tensor of
    ``shape``."""
    kind, axis, tiling, is_sync = steps.calls[:, used]
    tiles, t_inv = _distinct(tiling)
    m = np.array([float(max_local_numel(shape, steps.tiling_list[t], mesh) * itemsize) for t in tiles])[t_inv]
    kinds = list(steps.kinds)
    links, l_inv = _distinct(axis * len(kinds) + kind)
    ab = np.array([profile.ab(int(c) // len(kinds), kinds[int(c) % len(kinds)]) for c in links]).reshape(-1, 2)
    alpha, beta = ab[l_inv, 0], ab[l_inv, 1]
    if profile.beta_curves:  # beta at each message (``Profile.ab``)
        for li, c in enumerate(links.tolist()):
            idx = np.flatnonzero(l_inv == li)
            beta[idx] = profile.ab(c // len(kinds), kinds[c % len(kinds)], A.BACKEND, m[idx])[1]
    p = np.array(mesh.shape, dtype=float)[axis]
    f = np.array([RING_FACTOR.get(k, 0.0) for k in kinds])[kind]
    on = p > 1  # ``collective``: nothing on a group of one, or for a kind with no ring factor
    sent = np.where(on, f * (p - 1) / p * m, 0.0)
    seconds = np.where(on, f * (p - 1) * alpha + sent * beta, 0.0)
    sync = is_sync.astype(bool)
    if profile.algorithms != (A.BACKEND,):
        sent, seconds = _cheapest(sent, seconds, kinds, kind, sync, m, p, l_inv, links, profile)
    blocking = np.where(~sync & on, profile.blocking_s, 0.0)
    return sent, seconds + blocking, np.where(sync, seconds, 0.0)


def _distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` of small non-negative integers, by counting rather than sorting
    (pricing calls it on every collective of every route of every table)."""
    present = np.bincount(ids)
    values = np.flatnonzero(present)
    where = np.zeros(len(present), dtype=np.int64)
    where[values] = np.arange(len(values))
    return values, where[ids]


def _cheapest(sent: np.ndarray, seconds: np.ndarray, kinds: list[str], kind: np.ndarray, sync: np.ndarray,
              m: np.ndarray, p: np.ndarray, l_inv: np.ndarray, links: np.ndarray,
              profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    """``choose`` over arrays: each collective's bytes and seconds under its cheapest allowed algorithm (the
    backend's figures come in; the same arithmetic as ``choose``, so the figures agree bit for bit)."""
    mine = np.array([k in A.COLLECTIVES for k in kinds])[kind] & ~sync & (p > 1)
    if not mine.any():
        return sent, seconds
    sent, seconds = sent.copy(), seconds.copy()
    rows = np.flatnonzero(mine)
    for li in np.unique(l_inv[rows]):  # one (mesh axis, collective) at a time
        idx = rows[l_inv[rows] == li]
        c = int(links[li])
        k_name = kinds[c % len(kinds)]
        names = allowed(profile, k_name)
        if A.BACKEND not in names:
            seconds[idx] = np.inf
        mm, pp = m[idx], p[idx]
        for name in names:
            if name == A.BACKEND:
                continue
            a, b = profile.ab(c // len(kinds), k_name, name, mm)
            k = A.lp_chunks(k_name, mm, pp, a, b) if name == "lp" else np.ones_like(mm, dtype=np.int64)
            rounds, by = A.terms(k_name, name, mm, pp, k)
            sec = rounds * a + by * b
            better = sec < seconds[idx]
            seconds[idx[better]] = sec[better]
            sent[idx[better]] = by[better]
    return sent, seconds
