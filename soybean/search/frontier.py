"""The memory budget solved exactly by variable elimination over (time, memory) Pareto frontiers.

Under a budget ``sum_v m_v[s_v] <= M`` no variable can be eliminated with one number per strategy
(``problem.reduce``): which strategy of ``v`` is best for a neighbour's strategy depends on the memory left
for the rest.  It can be eliminated with *every* (time, memory) pair that could still be best, the Pareto
frontier.  A factor over a scope ``S`` holds, per assignment ``a`` of ``S``, the points

    F(a) = pareto { (sum_f c_f, sum_f m_f) : the variables eliminated below ``F`` chosen, ``S = a`` }

and eliminating ``v`` joins the factors that hold ``v`` (pairs of points that agree on their common
variables add) and keeps, per assignment of the rest of their scope, the frontier over ``v``'s strategies:

    F_new(a) = pareto  U_t  (F_1 (+) F_2 (+) ...)(a, v = t)

A point another beats in both time and memory is never part of a better plan (the rest of the plan adds the
same to both), so the cheapest point of the last factors within ``M`` is the budgeted optimum: exact, with
no duality gap (``budget``'s Lagrangian leaves one).  The tables the planner meets are narrow after tying
(GPT-2's treewidth is 2, Llama's 3: the rotary tables meet every layer), so an elimination joins factors over
three or four variables.

Frontiers grow with every distinct memory sum, so points are dropped as soon as they cannot be part of a
plan that fits and beats ``upper`` (a plan already found, the Lagrangian's).  The bounds are exact: one
scalar elimination of the relaxed problem (unary ``c + lam m``, ``lam`` the Lagrangian's best multiplier)
in the same order, and one of memory alone, give per assignment of each factor's scope the least relaxed
cost and the least memory of everything outside it (``_outside``: the min-marginals of the rest, by a
downward pass).  A point ``(c, m)`` whose plan would fit and beat ``upper`` has

    c + lam m + out_lam(a)  <=  cost(x) + lam M  <  upper + lam M      and      m + out_mem(a) <= M,

so a point failing either is dropped; the band left is about the Lagrangian's duality gap.  Where a join
would exceed ``MAX_POINTS`` points, a joined table ``MAX_TABLE`` entries, or the deadline passes, ``TooLarge``
is raised and the caller falls back to the joint ILP.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from .budget import relaxed
from .problem import Problem

# Points a join may make (each a row of a few integers and two floats).
MAX_POINTS = 4_000_000
# Entries the dense table of one elimination (its joined scope) may hold: the bounds' scalar passes build it.
MAX_TABLE = 4_000_000
# Relative slack of the pruning comparisons: a point this close to a bound is kept (sums in another order).
SLACK = 1e-9


class TooLarge(Exception):
    """The elimination would make a factor too large (points or scope) or ran past its deadline."""


@dataclass(frozen=True)
class Step:
    """Eliminating ``var``: the factors ``joined`` (ids) over ``scope + (var,)``, making factor ``made`` over
    ``scope``."""

    var: int
    joined: tuple[int, ...]
    scope: tuple[int, ...]
    made: int


@dataclass(frozen=True)
class Schedule:
    """An elimination order of a problem's factors: ids ``0..n-1`` the unary tables, then one per pair table
    (``pairs``, in that order), then one per step; ``last`` the factors over no variable left at the end."""

    scopes: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...]
    steps: tuple[Step, ...]
    last: tuple[int, ...]


def schedule(p: Problem) -> Schedule:
    """Eliminate, each time, the variable whose joined table (its strategies times its neighbours') is smallest;
    ``TooLarge`` when one would exceed ``MAX_TABLE`` entries."""
    sizes = [len(u) for u in p.unary]
    pairs = tuple(p.edges)
    scopes: list[tuple[int, ...]] = [(v,) for v in range(p.n)] + [tuple(e) for e in pairs]
    holding: list[set[int]] = [set() for _ in range(p.n)]
    for i, sc in enumerate(scopes):
        for v in sc:
            holding[v].add(i)
    live = set(range(len(scopes)))
    alive = set(range(p.n))
    steps: list[Step] = []
    # Each variable's neighbours: the variables of the factors holding it, kept as eliminations join them (an
    # 80-layer stack's untied problem: ~600 thousand sizes asked for, each a walk over its factors before).
    near: list[set[int]] = [set() for _ in range(p.n)]
    for u, v in pairs:
        near[u].add(v)
        near[v].add(u)

    def around(v: int) -> tuple[int, ...]:
        return tuple(sorted(near[v]))

    def table(v: int) -> float:
        return math.prod(float(sizes[w]) for w in near[v]) * sizes[v]

    # The smallest table first, from a heap whose stale entries (a neighbourhood changed since) are pushed again.
    heap = [(table(v), v) for v in range(p.n)]
    heapq.heapify(heap)
    while alive:
        size, v = heapq.heappop(heap)
        if v not in alive:
            continue
        if (now := table(v)) != size:
            heapq.heappush(heap, (now, v))
            continue
        scope = around(v)
        if size > MAX_TABLE:
            raise TooLarge(f"eliminating a variable with {len(scope)} neighbours: a table of {size:.3g} entries")
        joined = tuple(sorted(holding[v]))
        made = len(scopes)
        scopes.append(scope)
        for i in joined:
            live.discard(i)
            for w in scopes[i]:
                holding[w].discard(i)
        live.add(made)
        for w in scope:
            holding[w].add(made)
            near[w].update(scope)
            near[w].discard(w)
            near[w].discard(v)
        for w in scope:
            heapq.heappush(heap, (table(w), w))
        alive.discard(v)
        steps.append(Step(v, joined, scope, made))
    return Schedule(tuple(scopes), pairs, tuple(steps), tuple(sorted(live)))


def _spread(table: np.ndarray, scope: tuple[int, ...], into: tuple[int, ...]) -> np.ndarray:
    """``table`` over ``scope`` laid out to broadcast over ``into`` (a superset)."""
    order = sorted(range(len(scope)), key=lambda i: into.index(scope[i]))
    t = np.transpose(table, order)
    shape = [1] * len(into)
    for i in order:
        shape[into.index(scope[i])] = table.shape[i]
    return t.reshape(shape)


def _outside(p: Problem, s: Schedule, unary: list[np.ndarray], pair: bool) -> dict[int, np.ndarray]:
    """Per made factor, over its scope: the least value of every table outside it, for the problem with
    ``unary`` tables (and ``p``'s pair tables when ``pair``, else none): an upward pass of scalar elimination in
    ``s``'s order, then a downward one."""
    tables: dict[int, np.ndarray] = {v: np.asarray(unary[v], float) for v in range(p.n)}
    for k, e in enumerate(s.pairs):
        tables[p.n + k] = np.asarray(p.edges[e], float) if pair else np.zeros(p.edges[e].shape)
    for st in s.steps:
        into = st.scope + (st.var,)
        total = sum(_spread(tables[i], s.scopes[i], into) for i in st.joined)
        tables[st.made] = np.asarray(total).min(axis=-1)
    out: dict[int, np.ndarray] = {}
    finals = {i: float(tables[i]) for i in s.last}
    for i in s.last:
        out[i] = np.asarray(sum(c for j, c in finals.items() if j != i))
    for st in reversed(s.steps):
        into = st.scope + (st.var,)
        spread = {i: _spread(tables[i], s.scopes[i], into) for i in st.joined}
        above = _spread(out[st.made], st.scope, into)
        for g in st.joined:
            if g < p.n + len(s.pairs):
                continue  # a problem's own table: no point of it is ever pruned by its outside
            rest = above + sum(t for i, t in spread.items() if i != g)
            rest = np.broadcast_to(rest, [len(p.unary[w]) for w in into])
            drop = tuple(a for a, w in enumerate(into) if w not in s.scopes[g])
            m = rest.min(axis=drop) if drop else rest
            kept = [w for w in into if w in s.scopes[g]]
            out[g] = np.transpose(m, [kept.index(w) for w in s.scopes[g]])
    return out


def _key(assign: np.ndarray, cols: list[int], sizes: list[int]) -> np.ndarray:
    """Each row's assignment of columns ``cols`` as one mixed-radix integer (``sizes``: each column's radix)."""
    key = np.zeros(len(assign), dtype=np.int64)
    for c, size in zip(cols, sizes):
        key = key * size + assign[:, c]
    return key


def _pareto(key: np.ndarray, cost: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """The rows no other row of the same ``key`` beats in both memory and time (of equal rows, one): sorted by
    key, memory, time, a row is kept when its time is below every earlier time of its key."""
    if len(key) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((cost, mem, key))
    k = key[order]
    _, rank = np.unique(cost[order], return_inverse=True)  # times compared exactly, as integers
    first = np.concatenate([[True], k[1:] != k[:-1]])
    group = np.cumsum(first) - 1
    # A segmented running minimum: every rank of group g + 1 is shifted below every rank of group g, so the
    # running minimum starts again at each group.
    shifted = rank.astype(np.int64) - group.astype(np.int64) * (int(rank.max()) + 1)
    running = np.minimum.accumulate(shifted)
    keep = first.copy()
    keep[1:] |= shifted[1:] < running[:-1]
    return order[keep]


@dataclass
class _Points:
    """A factor's points: the assignment of ``scope`` at each, its time and memory; a made factor also
    ``var``'s strategy and the point of each joined factor it sums."""

    scope: tuple[int, ...]
    assign: np.ndarray
    cost: np.ndarray
    mem: np.ndarray
    var: int = -1
    value: np.ndarray | None = None
    joined: tuple[int, ...] = ()
    refs: np.ndarray | None = None


def _join(a: _Points, b: _Points, sizes: list[int],
          most: int = MAX_POINTS) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray]:
    """The pairs of points of ``a`` and ``b`` that agree on their common variables (``sizes``: each variable's
    strategy count): the joined scope, its assignments, and each pair's point of ``a`` and of ``b`` (``TooLarge``
    past ``most`` pairs)."""
    common = [v for v in a.scope if v in b.scope]
    radix = [sizes[v] for v in common]
    ka = _key(a.assign, [a.scope.index(v) for v in common], radix)
    kb = _key(b.assign, [b.scope.index(v) for v in common], radix)
    order = np.argsort(kb, kind="stable")
    kb = kb[order]
    lo = np.searchsorted(kb, ka, side="left")
    counts = np.searchsorted(kb, ka, side="right") - lo
    total = int(counts.sum())
    if total > most:
        raise TooLarge(f"a join of {total} points")
    ia = np.repeat(np.arange(len(ka)), counts)
    ib = order[np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(total)]
    extra = [v for v in b.scope if v not in a.scope]
    assign = a.assign[ia]
    if extra:
        assign = np.hstack([assign, b.assign[ib][:, [b.scope.index(v) for v in extra]]])
    return a.scope + tuple(extra), assign, ia, ib


def _at(table: np.ndarray, scope: tuple[int, ...], of: tuple[int, ...], assign: np.ndarray) -> np.ndarray:
    """``table`` (over ``scope``) read at each row of ``assign`` (over ``of``, a superset)."""
    if not scope:
        return np.full(len(assign), float(table))
    return table[tuple(assign[:, of.index(w)] for w in scope)]


def solve_frontier(p: Problem, upper: float = float("inf"), multiplier: float = 0.0,
                   deadline: float = float("inf"), most: int = MAX_POINTS) -> list[int] | None:
    """The cheapest choice of ``p`` within its budget whose value is below ``upper``, exactly; None when no plan
    fits below ``upper`` (a plan of value ``upper`` already found is then optimal).  ``multiplier``: the budget's
    Lagrange multiplier the pruning prices memory at (any value is exact; the Lagrangian's best prunes most).
    ``TooLarge`` when the elimination outgrows ``most`` points in a join (``MAX_POINTS``) or ``MAX_TABLE`` or passes
    ``deadline`` (``time.perf_counter``)."""
    assert p.memory is not None and p.budget is not None
    budget = float(p.budget) * (1 + SLACK)
    sizes = [len(u) for u in p.unary]
    s = schedule(p)
    lam = max(0.0, float(multiplier))
    finite = np.isfinite(upper)
    limit = (upper + lam * float(p.budget)) * (1 + SLACK) if finite else np.inf
    if sum(float(m.min(initial=0.0)) for m in p.memory) > budget:
        return None  # memory is per variable: no plan fits at all
    out_rel = _outside(p, s, relaxed(p, lam).unary, True) if finite else {}
    out_mem = _outside(p, s, [np.asarray(m, float) for m in p.memory], False)

    pts: dict[int, _Points] = {}
    for v in range(p.n):
        pts[v] = _Points((v,), np.arange(len(p.unary[v]))[:, None], np.asarray(p.unary[v], float),
                         np.asarray(p.memory[v], float))
    for k, (u, v) in enumerate(s.pairs):
        C = p.edges[(u, v)]
        su, sv = np.meshgrid(np.arange(C.shape[0]), np.arange(C.shape[1]), indexing="ij")
        pts[p.n + k] = _Points((u, v), np.stack([su.ravel(), sv.ravel()], axis=1), np.asarray(C, float).ravel(),
                               np.zeros(C.size))
    for st in s.steps:
        if time.perf_counter() > deadline:
            raise TooLarge("the deadline passed")
        # The smallest scopes first: a factor within the scope joined so far adds points, not variables.
        ids = sorted(st.joined, key=lambda i: (len(s.scopes[i]), len(pts[i].cost)))
        first = pts[ids[0]]
        cur = _Points(first.scope, first.assign, first.cost, first.mem)
        refs = np.arange(len(first.cost))[:, None]
        for i in ids[1:]:
            scope, assign, ia, ib = _join(cur, pts[i], sizes, most)
            cur = _Points(scope, assign, cur.cost[ia] + pts[i].cost[ib], cur.mem[ia] + pts[i].mem[ib])
            refs = np.hstack([refs[ia], ib[:, None]])
            # Of the points of one assignment of the whole joined scope, one another beats stays beaten whatever
            # the rest adds: pruned after each join, so parallel factors (several frontiers on one pair) stay short.
            keep = _pareto(_key(cur.assign, list(range(len(scope))), [sizes[w] for w in scope]),
                           cur.cost, cur.mem)
            cur = _Points(scope, cur.assign[keep], cur.cost[keep], cur.mem[keep])
            refs = refs[keep]
        into = cur.scope
        ok = cur.mem + _at(out_mem[st.made], st.scope, into, cur.assign) <= budget
        if finite:
            ok &= cur.cost + lam * cur.mem + _at(out_rel[st.made], st.scope, into, cur.assign) <= limit
        at = into.index(st.var)
        others = [into.index(w) for w in st.scope]
        assign, cost, mem, refs = cur.assign[ok], cur.cost[ok], cur.mem[ok], refs[ok]
        keep = _pareto(_key(assign, others, [sizes[w] for w in st.scope]), cost, mem)
        if len(keep) == 0:
            return None  # no plan fits below ``upper``
        order = [ids.index(i) for i in st.joined]  # refs' columns in ``st.joined`` order
        pts[st.made] = _Points(st.scope, assign[keep][:, others], cost[keep], mem[keep], st.var,
                               assign[keep, at], st.joined, refs[keep][:, order])
        for i in st.joined:
            if i >= p.n + len(s.pairs):  # a made factor's assignments are not read again, its refs are
                pts[i].assign = np.zeros((0, 0), dtype=np.int64)
    return _cheapest(p, s, pts, budget, upper)


def _cheapest(p: Problem, s: Schedule, pts: dict[int, _Points], budget: float, upper: float) -> list[int] | None:
    """The cheapest fitting sum of one point per last factor (over no variable), below ``upper``, traced back
    through every elimination to a choice per variable; None when there is none."""
    cost, mem = np.zeros(1), np.zeros(1)
    refs = np.zeros((1, 0), dtype=np.int64)
    for i in s.last:
        f = pts[i]
        n = len(f.cost)
        ia, ib = np.repeat(np.arange(len(cost)), n), np.tile(np.arange(n), len(cost))
        cost, mem = cost[ia] + f.cost[ib], mem[ia] + f.mem[ib]
        refs = np.hstack([refs[ia], ib[:, None]])
        ok = np.flatnonzero((mem <= budget) & (cost < upper))
        keep = ok[_pareto(np.zeros(len(ok), dtype=np.int64), cost[ok], mem[ok])]
        cost, mem, refs = cost[keep], mem[keep], refs[keep]
    if len(cost) == 0:
        return None
    best = int(np.argmin(cost))
    choice = [-1] * p.n
    stack = [(i, int(refs[best, j])) for j, i in enumerate(s.last)]
    while stack:
        i, pt = stack.pop()
        f = pts[i]
        if f.var < 0:
            continue  # one of the problem's own tables: its variables are set by their eliminations
        assert f.value is not None and f.refs is not None
        choice[f.var] = int(f.value[pt])
        stack.extend((j, int(f.refs[pt, c])) for c, j in enumerate(f.joined))
    assert min(choice, default=0) >= 0
    # Summed in another order the plan's value may differ in its last bits from the point's: below ``upper`` as
    # ``Problem`` prices it, or none.
    return choice if p.evaluate(choice) < upper else None
