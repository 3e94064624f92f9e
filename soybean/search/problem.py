"""The search problem: pick one strategy per variable, minimising unary + pairwise costs.

    minimise   sum_v c_v[s_v]  +  sum_{(u,v) in E} C_uv[s_u, s_v]
    subject to sum_v m_v[s_v] <= M            (optional per-device memory budget)

The exact reductions here shrink a problem without changing its optimum
(without a memory budget): a *leaf* ``v`` with one neighbour ``u`` folds into
``c_u[s] += min_t (c_v[t] + C_uv[s, t])``; a *series* variable with two
neighbours folds into a new edge ``C'_uw[s, r] = min_t (C_uv[s,t] + c_v[t] + C_vw[t,r])``;
parallel edges add.  Parameters are leaves and activations form chains, so a
model usually shrinks to a small core; solvers work on the core and
``expand`` restores every eliminated choice from its recorded argmin.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Problem:
    unary: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)   # (u, v), u < v -> C[s_u, s_v]
    memory: list[np.ndarray] | None = None
    budget: float | None = None
    names: list[str] = field(default_factory=list)
    # Blocks of variables (a stack's layers, each block's variables ascending): ``reduce`` reduces a block's inside
    # once for every block of the same content (``reduce_blocks``).  A hint: the problem is the same without it.
    blocks: tuple[tuple[int, ...], ...] = ()

    @property
    def n(self) -> int:
        return len(self.unary)

    def add_edge(self, u: int, v: int, C: np.ndarray) -> None:
        if u == v:  # both ends the same variable: only the diagonal is reachable
            self.unary[u] = self.unary[u] + np.diag(C)
            return
        if u > v:
            u, v, C = v, u, C.T
        key = (u, v)
        # Never written in place (every update makes a new array), so a table is kept, not copied.
        self.edges[key] = self.edges[key] + C if key in self.edges else np.asarray(C, dtype=float)

    def neighbours(self) -> list[set[int]]:
        nb: list[set[int]] = [set() for _ in range(self.n)]
        for u, v in self.edges:
            nb[u].add(v)
            nb[v].add(u)
        return nb

    def evaluate(self, choice: list[int]) -> float:
        total = sum(float(self.unary[v][choice[v]]) for v in range(self.n))
        for (u, v), C in self.edges.items():
            total += float(C[choice[u], choice[v]])
        return total

    def memory_of(self, choice: list[int]) -> float:
        if self.memory is None:
            return 0.0
        return sum(float(self.memory[v][choice[v]]) for v in range(self.n))


@dataclass
class Reduced:
    """A core problem over the surviving variables, plus how to restore the rest."""

    core: Problem
    keep: list[int]                            # core index -> original index
    trail: list[tuple] = field(default_factory=list)  # elimination records, in order

    def expand(self, core_choice: list[int], n: int) -> list[int]:
        choice = [-1] * n
        for ci, v in enumerate(self.keep):
            choice[v] = core_choice[ci]
        for rec in reversed(self.trail):
            kind = rec[0]
            if kind == "leaf":
                _, v, u, arg = rec
                choice[v] = int(arg[choice[u]])
            elif kind == "series":
                _, v, u, w, arg = rec
                choice[v] = int(arg[choice[u], choice[w]])
            else:  # isolated
                choice[rec[1]] = rec[2]
        return choice


def min_plus(A: np.ndarray, B: np.ndarray, block: int = 1 << 16,
             argmin: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """``M[i, k] = min_j A[i, j] + B[j, k]`` and its argmin (None without ``argmin``), in row blocks of about
    ``block`` sums.

    The sums are laid out ``[i, k, j]`` so the reductions run along contiguous memory (twice as fast as reducing
    the middle axis), written into one buffer of 2^16 sums (512 KiB) that stays in a core's cache, where a new
    array was allocated per block before; with ``argmin`` the minima are read at it, not found by a second pass
    over the sums (both together: a Llama-3-8B 16x8x8 cap search's reductions 9.2 -> 5.5 s).  Ties go to the
    smallest ``j``."""
    n, m = A.shape
    k = B.shape[1]
    rows = max(1, block // max(1, m * k))
    Bt = np.ascontiguousarray(B.T)
    M = np.empty((n, k))
    arg = np.empty((n, k), dtype=np.int64) if argmin else None
    buf = np.empty((min(rows, n), k, m))
    for i in range(0, n, rows):
        r = min(rows, n - i)
        T = buf[:r]
        np.add(A[i:i + r, None, :], Bt[None, :, :], out=T)
        if arg is None:
            M[i:i + r] = T.min(axis=2)
            continue
        at = T.argmin(axis=2)
        arg[i:i + r] = at
        M[i:i + r] = T.reshape(r * k, m)[np.arange(r * k), at.ravel()].reshape(r, k)
    return M, arg


def reduce(p: Problem, argmins: bool = True, boundary: frozenset[int] = frozenset()) -> Reduced:
    """Apply leaf, series and isolated-variable eliminations until none applies.  Without ``argmins`` the
    eliminated variables' best choices are not recorded (a fifth less work): the result bounds (``lower_bound``,
    ``diffusion.diffusion_bound``), it cannot ``expand``.  ``boundary``: variables never eliminated (a
    block's boundary: the block reduced alone, its boundary left for the problem around it).  A problem with ``blocks``
    of which two or more have one content is reduced block by block first (``reduce_blocks``): the same core, the
    same optimum, each distinct block's inside reduced once."""
    if p.budget is not None:  # memory couples all variables: no exact local elimination
        return Reduced(Problem(list(p.unary), dict(p.edges), p.memory, p.budget, p.names), list(range(p.n)))
    if p.blocks and not boundary and (by_blocks := reduce_blocks(p, argmins)) is not None:
        return by_blocks
    unary = [np.asarray(u, dtype=float) for u in p.unary]  # replaced, never written in place
    edges = dict(p.edges)
    nb = p.neighbours()
    alive = set(range(p.n))
    trail: list[tuple] = []

    def get(u: int, v: int) -> np.ndarray:
        return edges[(u, v)] if u < v else edges[(v, u)].T

    def put(u: int, v: int, C: np.ndarray) -> None:
        if u > v:
            u, v, C = v, u, C.T
        edges[(u, v)] = edges[(u, v)] + C if (u, v) in edges else C

    def drop(u: int, v: int) -> None:
        edges.pop((min(u, v), max(u, v)))
        nb[u].discard(v)
        nb[v].discard(u)

    def cost(v: int) -> int | None:
        """What eliminating ``v`` now costs (sums of a series elimination; 0 for a leaf), None: not now."""
        if v in boundary:
            return None
        if len(nb[v]) < 2:
            return 0
        if len(nb[v]) > 2:
            return None
        u, w = nb[v]
        return len(unary[u]) * len(unary[v]) * len(unary[w])

    def push(v: int) -> None:
        if (c := cost(v)) is not None:
            heapq.heappush(work, (c, v))

    # Cheapest elimination first: the core is the same in any order, but the tables met on the way are not
    # (a Llama-3-8B tied core on 16x8x8: 310 million sums of series eliminations this way, 392 million last first).
    work: list[tuple[int, int]] = []
    for v in range(p.n):
        push(v)
    while work:
        c, v = heapq.heappop(work)
        if v not in alive:
            continue
        if cost(v) != c:  # its neighbourhood changed since it was queued: queued again at its cost now
            push(v)
            continue
        deg = len(nb[v])
        if deg == 0:
            best = int(np.argmin(unary[v]))  # its unary holds every variable folded into it: kept for ``isolated``
            trail.append(("isolated", v, best, float(unary[v][best])))
            alive.discard(v)
        elif deg == 1:
            (u,) = nb[v]
            M = get(u, v) + unary[v][None, :]
            trail.append(("leaf", v, u, M.argmin(axis=1) if argmins else None))
            unary[u] = unary[u] + M.min(axis=1)
            drop(u, v)
            alive.discard(v)
            push(u)
        else:
            u, w = sorted(nb[v])
            A, Bm = get(u, v) + unary[v][None, :], get(v, w)
            if A.shape[0] * A.shape[1] * Bm.shape[1] > 200_000_000:
                continue
            M, arg = min_plus(A, Bm, argmin=argmins)
            trail.append(("series", v, u, w, arg))
            drop(u, v)
            drop(v, w)
            put(u, w, M)
            nb[u].add(w)
            nb[w].add(u)
            alive.discard(v)
            push(u)
            push(w)
    keep = sorted(alive)
    pos = {v: i for i, v in enumerate(keep)}
    core = Problem([unary[v] for v in keep], {}, None, None, [p.names[v] for v in keep] if p.names else [])
    for (u, v), C in edges.items():
        core.add_edge(pos[u], pos[v], C)
    return Reduced(core, keep, trail)


def lower_bound(red: Reduced, p: Problem) -> float:
    """A lower bound of ``p``'s optimum, from its reduction, at the cost of one min per row.

    ``OPT(p) = OPT(core) + sum of the isolated variables' cheapest unary`` (the eliminations are exact),
    and with every core edge charged to its lower end ``u``,

        OPT(core) >= sum_u min_s ( c_u[s] + sum_{(u,v)} min_t C_uv[s, t] ),

    since each term is at most what the optimum pays for ``u`` and the edges charged to it.  The planner
    compares it with the best step time another mesh reached, and skips the mesh's solve when the bound
    already reaches it: on a 64-device Llama-3-8B a 2x2x16 mesh's bound (0.19 s) exceeds 8x8's optimum
    (0.056 s, 3 layers) before its 10-second LP.
    """
    rows = [u.astype(float) for u in red.core.unary]
    for (u, _), C in red.core.edges.items():
        rows[u] = rows[u] + C.min(axis=1)
    return isolated(red) + sum(float(r.min()) for r in rows)


def isolated(red: Reduced) -> float:
    """What the variables the reduction found isolated cost at their cheapest, with all it folded into them (the
    leaves and series eliminated into each): ``OPT(p) - OPT(core)`` for the problem ``p`` reduced."""
    return sum(rec[3] for rec in red.trail if rec[0] == "isolated")


# ---- blocks: a repeated sub-problem reduced once -------------------------------------------------------------

# Blocks of fewer variables are left to the reduction of the whole: their inside is no work to share.
MIN_BLOCK = 4


def reduce_blocks(p: Problem, argmins: bool = True) -> Reduced | None:
    """``reduce(p)`` with each block of ``p.blocks`` reduced alone first, its boundary kept (the variables with an
    edge leaving the block), and the reduction of one content used for every block of that content (a stack of
    equal layers: one layer's reduction, 32 times); then the problem of the blocks' cores and the other variables
    is reduced as a whole.  Eliminations are exact in any order, so the core is the one ``reduce`` leaves and the
    optimum is ``p``'s; only the order of the sums differs (the bounds agree to rounding).  None when no two blocks
    share a content (nothing to share: ``reduce`` reduces the whole at once).

    A block's content is its variables' costs in order, its inner edges' tables (a read-only table by identity: the
    planning graph shares one between equal layers and never writes it; any other by value) and which of its
    variables are its boundary.  Llama-3-8B's table on 2x2x2 (32 equal layers, 448 variables left in its core):
    8.1 s reduced whole, 1.2 s by blocks."""
    return _by_blocks(p, argmins, None, 0, None)


def reduce_tied(p: Problem, to: Sequence[int], n: int, cache: dict | None = None) -> Reduced:
    """The reduction of ``p`` tied by ``to`` (``tying.tie``'s map onto ``n`` variables), for bounds (no argmins:
    ``lower_bound``, ``diffusion.diffusion_bound``), composed from its blocks' reductions: each block's inside is
    reduced once per content and placed at its tied variables (a block tied onto another adds its reduction onto
    that one's: the tied problem's sum of equal layers, reduced once), then the composed problem is reduced.  The
    tied problem's optimum, to rounding: a block's inside is the same function of its boundary wherever it is.
    ``cache``: reductions of blocks by content kept across calls (a planner's choices and multipliers share their
    layers: nothing recomputed is the same layer in every choice), at most ``CACHED_BLOCKS``."""
    got = _by_blocks(p, False, to, n, cache)
    assert got is not None
    return got


# Block reductions a ``reduce_tied`` cache keeps (the oldest dropped first): a 3-axis mesh's layer keeps ~18 variables
# with tables of up to 343 x 216 strategies in its core, a few MB.
CACHED_BLOCKS = 32


def _by_blocks(p: Problem, argmins: bool, to: Sequence[int] | None, n: int, cache: dict | None) -> Reduced | None:
    """``reduce_blocks`` (``to`` None: every variable its own) and ``reduce_tied`` (``to``: each variable's tied
    variable; no argmins)."""
    assert to is None or not argmins, "a tied reduction is for bounds: its eliminations are not recorded"
    at: dict[int, int] = {}
    for b, vs in enumerate(p.blocks):
        for v in vs:
            at[v] = b
    inner: list[list[tuple[int, int, np.ndarray]]] = [[] for _ in p.blocks]
    outer: list[tuple[int, int, np.ndarray]] = []
    bound: list[set[int]] = [set() for _ in p.blocks]  # each block's boundary
    for (u, v), C in p.edges.items():
        bu, bv = at.get(u), at.get(v)
        if bu is not None and bu == bv:
            inner[bu].append((u, v, C))
            continue
        outer.append((u, v, C))
        if bu is not None:
            bound[bu].add(u)
        if bv is not None:
            bound[bv].add(v)
    kept: list[object] = []  # the tables keyed by identity, held so that no id is reused while the keys live
    keys = [_block_key(p, vs, inner[b], bound[b], kept) if len(vs) >= MIN_BLOCK else None
            for b, vs in enumerate(p.blocks)]
    if to is None:
        counts: dict[object, int] = {}
        for k in keys:
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        if not any(c >= 2 for c in counts.values()):
            return None
    done: dict = cache if cache is not None else {}
    place = (lambda v: v) if to is None else (lambda v: to[v])
    index: dict[int, int] = {}   # a variable's place (itself, or its tied variable) -> its index in ``whole``
    origin: list[int] = []        # ... and back
    unary: list[np.ndarray] = []
    trail: list[tuple] = []

    def at_place(t: int, cost: np.ndarray) -> int:
        i = index.get(t)
        if i is None:
            i = index[t] = len(unary)
            origin.append(t)
            unary.append(np.asarray(cost, dtype=float))
        else:
            unary[i] = unary[i] + cost
        return i

    for v in range(p.n):  # the variables in no block reduced alone, as they are
        if (blk := at.get(v)) is None or keys[blk] is None:
            at_place(place(v), p.unary[v])
    inside: list[tuple[Reduced, tuple[int, ...]]] = []
    for b, vs in enumerate(p.blocks):
        if keys[b] is None:
            continue
        entry = done.get(keys[b])
        if entry is None:
            local = {v: i for i, v in enumerate(vs)}
            sub = Problem([p.unary[v] for v in vs], {})
            for u, v, C in inner[b]:
                sub.add_edge(local[u], local[v], C)
            entry = (reduce(sub, argmins, boundary=frozenset(local[v] for v in bound[b])), kept)
            if cache is not None and len(done) >= CACHED_BLOCKS:
                done.pop(next(iter(done)))
            done[keys[b]] = entry
        red = entry[0]
        inside.append((red, vs))
        for i, li in enumerate(red.keep):
            at_place(place(vs[li]), red.core.unary[i])
    whole = Problem(unary, {}, None, None, [p.names[v] for v in origin] if p.names and to is None else [])
    for red, vs in inside:
        for (cu, cv), C in red.core.edges.items():
            whole.add_edge(index[place(vs[red.keep[cu]])], index[place(vs[red.keep[cv]])], C)
        if to is None:
            trail.extend(_moved(rec, vs) for rec in red.trail)
        else:  # only what the block's isolated variables cost counts for a bound (``isolated``)
            trail.extend(rec for rec in red.trail if rec[0] == "isolated")
    for b, edges in enumerate(inner):
        if keys[b] is None:  # a block too small to reduce alone: its edges are the whole's
            outer.extend(edges)
    for u, v, C in outer:
        whole.add_edge(index[place(u)], index[place(v)], C)
    rest = reduce(whole, argmins)
    trail.extend(_moved(rec, origin) for rec in rest.trail)
    return Reduced(rest.core, [origin[i] for i in rest.keep], trail)


def _block_key(p: Problem, vs: tuple[int, ...], inner: list[tuple[int, int, np.ndarray]], bound: set[int],
               kept: list[object]) -> tuple:
    """What a block's reduction depends on (``reduce_blocks``), as a hashable value."""
    local = {v: i for i, v in enumerate(vs)}
    costs = tuple((u.dtype.str, u.shape, u.tobytes()) for u in (np.asarray(p.unary[v], dtype=float) for v in vs))
    tables: list[tuple] = []
    for u, v, C in inner:
        if C.flags.writeable:
            tables.append((local[u], local[v], C.dtype.str, C.shape, C.tobytes()))
        else:
            kept.append(C)
            tables.append((local[u], local[v], id(C)))
    return costs, tuple(sorted(tables, key=lambda t: t[:2])), tuple(sorted(local[v] for v in bound))


def _moved(rec: tuple, to: tuple[int, ...] | list[int]) -> tuple:
    """An elimination record of a sub-problem with its variables renamed by ``to`` (sub-problem index -> index)."""
    kind = rec[0]
    if kind == "leaf":
        return ("leaf", to[rec[1]], to[rec[2]], rec[3])
    if kind == "series":
        return ("series", to[rec[1]], to[rec[2]], to[rec[3]], rec[4])
    return ("isolated", to[rec[1]], rec[2], rec[3])
