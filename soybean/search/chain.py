"""Lower bounds over a chain of recomputation choices, without solving each one.

A chain (``planner.recompute_choices``) recomputes the first ``k`` layers of a stack (or their attention alone), ``k``
growing.  Choice ``k``'s
budgeted optimum ``OPT_k = min {T_k(x) : M_k(x) <= B}`` is bounded, for every multiplier ``lam >= 0``, by

    F_k(lam) = min_x  T_k(x) + lam * (M_k(x) - B)  <=  OPT_k          (weak duality)

with ``T`` member 0 of the capped overlap and ``M`` the activations phase without the rerun buffers: the costs and
memory of the problem ``dual`` is given (``planner.problem.chain_dual`` reads them from a choice's table).

Why whole stretches of a chain are bounded at once: the search ties repeated layers (``tying``), and the tied
problem of choice ``k`` is ``[layer 0][run of recomputed layers][the last recomputed layer][run of kept
layers][last layer]``: one more recomputed layer moves one layer's costs, memory and edges from the kept run's sums
to the recomputed run's.  So while the runs keep that shape, every entry of the tied problem is affine in ``k``,
each tied plan's Lagrangian cost is affine in ``k``, and ``F_k(lam)``, their minimum, is concave in ``k``: on
``a <= k <= b`` it is at least ``min(F_a(lam), F_b(lam))``.  With lower bounds ``l(lam) <= F(lam)`` (min-sum
diffusion on the reduced tied problem, ``diffusion.diffusion_bound``) at a grid of multipliers,

    min_{a <= k <= b} OPT_k  >=  max_lam min(l_a(lam), l_b(lam))          (``stretch_bound``)

Two choices bound the stretch between them only when their tied problems have the same shape (``Dual.shape``:
variables, strategy counts, edges); a stretch whose ends differ is bounded by ``pieces``: the widest stretch inside it
whose ends agree, and each choice peeled off outside it by its own dual.  The affinity itself is checked at every
choice the search evaluates inside a stretch (``affine``), and a chain that fails the check loses its stretch bounds
(the caller's fallback).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .budget import relaxed
from .diffusion import diffusion_bound
from .problem import Problem, reduce, reduce_tied
from .tying import Run, tie

# The multipliers tried, as multiples of a step time per budget (seconds per byte), in the order tried: on
# Llama-3-70B on 512 devices the best multiplier of each choice lay at 0.15-0.45 of the best step time over the
# budget.  Each costs a reduction of the tied problem (about a second there), so they are tried lazily (``tighten``).
MULTIPLIERS = (0.3, 0.2, 0.45, 0.15, 0.7, 0.1, 1.0, 0.05, 0.0, 1.5)
# Multipliers ``tighten`` tries at most: past the first few a bound rarely gains enough to prune.
TIGHTEN = 4
# Choices ``pieces`` peels off each end of a stretch at most, each bounded by its own dual, to reach two ends whose
# tied problems share a shape.  Without peeling, a stretch that ended at every layer recomputed, or at a run too short
# to tie, was bounded by the plain table's bound alone: Llama-3-70B on 64 devices (8x4x2) reported a 19.0% gap
# where every choice's dual stood above 1.74 s of its 1.77 s plan.
PEEL = 3
# Relative tolerance of the affinity check (sums of equal layers' costs in another order).
AFFINE_RTOL = 1e-7


@dataclass
class Dual:
    """One recomputation choice's tied problem (costs, memory without rerun buffers) and the lower bounds
    ``lower[i]`` of ``F_k(lams[i])`` worked out so far (``-inf``: not yet)."""

    k: int
    problem: Problem
    lams: np.ndarray
    budget: float
    lower: np.ndarray
    runs: tuple[Run, ...] = ()
    to: tuple[int, ...] = ()     # each variable of the table -> its variable in ``problem`` (``tying.tie``)
    rerun: tuple[bool, ...] = ()  # each variable of ``problem``: whether it reruns
    # The untied problem, whose layers (``Problem.blocks``) ``at`` reduces once per content into ``problem``'s
    # reduction (``problem.reduce_tied``), with ``cache``, the caller's reductions of layers kept across choices.
    untied: Problem | None = field(default=None, repr=False, compare=False)
    cache: dict | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple:
        """What two choices must share for the line between them to hold: the tied problem's variables, strategy
        counts and edges, and which variables rerun (nothing recomputed and every layer recomputed tie to
        problems of one size, and are not two ends of one line)."""
        p = self.problem
        return (tuple(u.shape for u in p.unary), tuple((e, C.shape) for e, C in sorted(p.edges.items())),
                self.rerun)

    @property
    def bound(self) -> float:
        """The best bound of this choice alone, of the multipliers tried."""
        return float(self.lower.max())

    def at(self, i: int) -> float:
        """The lower bound at multiplier ``lams[i]``: min-sum diffusion on the reduced relaxed problem (reduced from
        the untied problem's layers where it is kept, ``reduce_tied``: equal layers of any choice reduced once)."""
        if self.lower[i] == -np.inf:
            lam = float(self.lams[i])
            if self.untied is not None:
                r = self.problem
                red = reduce_tied(relaxed(self.untied, lam), self.to, r.n, self.cache)
            else:
                r = relaxed(self.problem, lam)
                red = reduce(r, argmins=False)
            self.lower[i] = diffusion_bound(red, r) - lam * self.budget
        return float(self.lower[i])


def dual(p: Problem, k: int, runs: Sequence[Run], lams: np.ndarray, budget: float, reruns: Sequence[bool],
         cache: dict | None = None) -> Dual:
    """Choice ``k``'s ``Dual`` on its problem ``p`` (``T`` and ``M``: ``p.memory`` is set), tied by ``runs``, under
    ``budget`` bytes, with its bound at the first multiplier worked out; ``reruns``: which variables of ``p``
    rerun; ``cache``: reductions of ``p``'s layers by content, shared with the caller's other duals (``Dual.at``)."""
    assert p.memory is not None
    q, to = tie(p, list(runs)) if runs else (p, list(range(p.n)))
    rerun = [False] * q.n
    for v, j in enumerate(to):
        rerun[j] = reruns[v]
    d = Dual(k, q, np.asarray(lams, dtype=float), budget, np.full(len(lams), -np.inf), tuple(runs), tuple(to),
             tuple(rerun), p if p.blocks else None, cache)
    d.at(0)
    return d


def stretch_bound(a: Dual, b: Dual) -> float:
    """A lower bound of ``OPT_k`` for every ``a.k <= k <= b.k`` (module docstring), of the multipliers both have
    tried; ``-inf`` when the two tied problems differ in shape (the runs changed between them: no bound)."""
    if a.shape != b.shape:
        return -np.inf
    return float(np.minimum(a.lower, b.lower).max())


def pieces(a: int, b: int, dual_of: Callable[[int], Dual | None], peel: int = PEEL) -> list[list[Dual]]:
    """Duals that bound every choice of stretch ``[a, b]`` (``a < b``) of a chain together: the two ends of the
    widest stretch inside it whose ends' tied problems share a shape (``stretch_bound`` holds between them), with
    each choice peeled off outside it (at most ``peel`` at each end: a chain's first and last choices tie to problems
    of other sizes -- nothing or every layer recomputed, runs of recomputed or kept layers too short to tie) alone;
    ``dual_of(i)``: choice ``i``'s dual (None: none; asked lazily, the fewest peeled first).  Empty where no two such
    ends are found."""
    spans = sorted(((a + i, b - j) for i in range(peel + 1) for j in range(peel + 1)),
                   key=lambda x: (x[0] - a + b - x[1], x[0] - a))
    for lo, hi in spans:
        if lo < hi and (dl := dual_of(lo)) is not None and (dh := dual_of(hi)) is not None and dl.shape == dh.shape:
            alone = [dual_of(i) for i in [*range(a, lo), *range(hi + 1, b + 1)]]
            if any(d is None for d in alone):
                return []
            return [[d] for d in alone if d is not None] + [[dl, dh]]
    return []


def pieces_bound(parts: Sequence[Sequence[Dual]], target: float | None = None) -> float:
    """The bound of a stretch from its ``pieces``: the least of theirs (a single's ``Dual.bound``, a pair's
    ``stretch_bound``), each below ``target`` tightened towards it (``tighten``); ``-inf`` without pieces."""
    got = np.inf if parts else -np.inf
    for ds in parts:
        here = ds[0].bound if len(ds) == 1 else stretch_bound(ds[0], ds[1])
        got = min(got, tighten(ds, target) if target is not None and here < target else here)
    return float(got)


def tighten(duals: Sequence[Dual], target: float, upto: int = TIGHTEN) -> float:
    """Try more multipliers (the first ``upto``) until the bound of ``duals`` together (``Dual.bound`` of one,
    ``stretch_bound`` of two) reaches ``target``; the bound reached."""
    def now() -> float:
        return duals[0].bound if len(duals) == 1 else stretch_bound(duals[0], duals[1])

    if len(duals) == 2 and duals[0].shape != duals[1].shape:
        return -np.inf
    for i in range(min(upto, len(duals[0].lams))):
        if (b := now()) >= target:
            return b
        for d in duals:
            d.at(i)
    return now()


def affine(a: Dual, m: Dual, b: Dual) -> bool:
    """Whether ``m``'s tied problem lies on the line through ``a``'s and ``b``'s (every unary cost, memory and edge
    cost: ``q_m = q_a + t (q_b - q_a)``, ``t = (m.k - a.k) / (b.k - a.k)``), as ``stretch_bound`` assumes."""
    if not (a.shape == m.shape == b.shape) or not a.k < m.k < b.k:
        return False
    t = (m.k - a.k) / (b.k - a.k)
    pa, pm, pb = a.problem, m.problem, b.problem
    assert pa.memory is not None and pm.memory is not None and pb.memory is not None

    def on_line(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> bool:
        line = x + t * (z - x)
        scale = max(float(np.abs(x).max(initial=0.0)), float(np.abs(z).max(initial=0.0)), 1e-300)
        return bool(np.all(np.abs(y - line) <= AFFINE_RTOL * scale))

    pairs = list(zip(pa.unary, pm.unary, pb.unary)) + list(zip(pa.memory, pm.memory, pb.memory))
    pairs += [(pa.edges[e], pm.edges[e], pb.edges[e]) for e in pa.edges]
    return all(on_line(x, y, z) for x, y, z in pairs)

