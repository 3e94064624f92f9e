"""Recomputation under a memory budget: which layers to rerun, searched with the tilings (``solve_recompute``:
chains of recomputation choices, each priced by a solve of its table, pruned by Lagrangian bounds), and the
options a user could give where no plan fits (``budget_hints``)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..capture.core import Captured, capture, split_example
from ..graph import (
    PlanGraph,
    SharedWork,
    attention_units,
    layer_of,
    recomputable_layers,
)
from ..mesh import Mesh
from ..search import Pruned, Run, SearchError, Solution, relative_gap
from ..search.problem import Problem, lower_bound, reduce
from .problem import chain_dual, free_bound, to_problem
from .repeats import find_repeats
from .solve import (
    Incumbent,
    MemoryBudgetError,
    Result,
    Search,
    SearchStopped,
    enough_memory,
    evaluate,
    least_memory,
    now,
    solve_table_on,
)

# ``replicated``: the optimum with every parameter stored whole on every device (its use still split where that
# pays), as the torch.compile backend runs plans on the user's own parameters (``soybean.compile``).


def recompute_units(cap: Captured, recompute: str) -> frozenset[str]:
    """The units a fixed ``recompute`` choice reruns (``none``, ``layers``, ``attention``)."""
    units: dict[str, Callable[[Captured], Sequence[str]]] = {
        "none": lambda c: (), "layers": recomputable_layers, "attention": attention_units}
    return frozenset(units[recompute](cap))  # only the one asked for: each reads every node's op


def recompute_choices(cap: Captured) -> list[list[frozenset[str]]]:
    """The recomputation choices ``solve_recompute`` searches, as chains along which the step time can only
    grow: ``A_k``, the first ``k`` recomputable layers (graph order) recomputed whole; ``B_k``, the same with
    every other layer's attention recomputed (selective recomputation, where the layers have one); ``C_k``, the
    attention of the first ``k`` layers alone, nothing else (selective recomputation where only some layers need
    it: between nothing, ``A_0``, and every attention, ``B_0``, which close the chain at either end and are not
    repeated in it).  ``k = 1`` is left out: a role's single recomputed unit keeps its whole activations as its
    rerun buffer, so it never saves memory over ``k = 0`` and only adds time.  ``chain_counts`` gives each
    choice's ``k``."""
    layers = recomputable_layers(cap)
    att = {layer_of(u): u for u in attention_units(cap)}
    ks = [k for k in range(len(layers) + 1) if k != 1]
    chains = [[frozenset(layers[:k]) for k in ks]]
    if att:
        chains.append([frozenset(layers[:k]) | {att[x] for x in layers[k:] if x in att} for k in ks[:-1]])
        some = [frozenset(att[x] for x in layers[:k] if x in att) for k in ks[1:-1]]
        if len(some) >= 2 and len(set(some)) == len(some):  # every layer has its attention: a chain of k = 2..L-1
            chains.append(some)
    return chains


def reruns_within(units: frozenset[str], more: frozenset[str]) -> bool:
    """Whether recomputation choice ``more`` reruns every op ``units`` reruns: each unit of ``units`` is one of
    ``more`` or lies inside one (a layer's attention inside the layer: ``B_k`` reruns all of ``A_k``)."""
    return all(u in more or any(u.startswith(w + ".") for w in more) for u in units)


def layers_in(units: frozenset[str], layers: Collection[str]) -> int:
    """How many whole layers a recomputation choice reruns: the ``k`` of ``A_k`` and ``B_k``."""
    return sum(1 for u in units if u in layers)


def chain_counts(cap: Captured, chains: Sequence[Sequence[frozenset[str]]]) -> list[list[int]]:
    """The ``k`` of each choice of each chain of ``recompute_choices``: its whole layers (``A_k``, ``B_k``), or, in
    a chain that reruns no whole layer, its attention units (``C_k``).  The graph's layers and attention units are
    read once for every chain (each reads every node's op)."""
    layers, att = set(recomputable_layers(cap)), set(attention_units(cap))
    out = []
    for chain in chains:
        counted = layers if any(u in layers for u in chain[-1]) else att
        out.append([layers_in(units, counted) for units in chain])
    return out


def solve_plain(cap: Captured, mesh: Mesh, search: Search, incumbent: Incumbent = None) -> Result:
    """The fastest plan on ``mesh`` with nothing recomputed and no memory budget (``Pruned`` when its bound reaches
    ``incumbent``).  Recomputation only adds time (``solve_recompute``), so its ``solution.bound`` bounds every
    recomputation choice's plans under any budget, and when its plan fits the budget it is the best of them all.
    When member 0's plan (``capped_overlap``) breaks the budget, that plan and its bound are returned without the
    cap's search: the mesh needs the recomputation search anyway, which the bound already serves."""
    return _solve_free(search.table(cap, mesh), search, incumbent)


def _solve_free(plain: PlanGraph, search: Search, incumbent: Incumbent) -> Result:
    """``solve_plain``'s solve of the plain table already built."""
    budget = search.memory_bytes
    return solve_table_on(plain, replace(search, memory_bytes=None), incumbent,
                          settle=lambda r: budget is not None and r.memory > budget)


def solve_recompute(cap: Captured, mesh: Mesh, search: Search, incumbent: Incumbent = None,
                    say: Callable[[str], None] = lambda line: None, floor: float | None = None,
                    free: Sequence[int] | None = None) -> Result:
    """Recomputation decided with the tilings: the best plan on ``mesh`` over every choice of
    ``recompute_choices`` (each solved exactly with its tilings), within ``memory_bytes``.

    Recomputation only adds time (``T(tiling, A) <= T(tiling, A')`` for ``A`` inside ``A'``: a rerun adds its
    compute ``d`` and its reshards, and lets backward hide at most ``BACKWARD_SHARE * d`` more), so the lower bound
    of the table with nothing recomputed (``search.lower_bound``) bounds every choice: a mesh whose bound reaches
    ``incumbent`` is pruned after one table; and when the fastest plan with nothing recomputed, found without the
    budget (``solve_plain``), fits it, it is the answer of every choice, else its bound (``floor``, when the caller
    solved it) bounds them all.  Along a chain each step recomputes more ops, so the least memory any plan reaches
    only shrinks: the first choice that can fit the budget is found by bisection on it (the choices before it
    cannot fit).  From there the step time is not monotone in the choice (more recomputation frees memory for a
    faster layout), so the rest of each chain is searched by branch and bound (``chain_search``) on stretches of
    choices bounded at once (``search.chain``).  Exact over the choices searched, to ``gap`` and within
    ``time_limit_s`` of search after the first solve (the bound of what is left then is the result's bound); for a
    stack of equal layers, which ``k`` layers are recomputed does not change the model, so ``A_k`` stands for any
    ``k``.  ``free``: the choice of the plain table's fastest plan, when the caller solved it (``floor``'s plan):
    where it fits the budget with every layer recomputed, ``budget_bound`` is known not to prune and is skipped."""
    objective, budget = search.options.objective, search.memory_bytes
    least: dict[frozenset[str], float] = {}  # each choice's least memory (``least_memory``: a lower bound)
    enough: dict[frozenset[str], float] = {}  # and the memory its error names (``enough_memory``)
    recent: dict[frozenset[str], PlanGraph] = {}  # the last tables built, for the solve that follows a probe
    work = SharedWork()  # the layers two choices treat alike are built once

    def table(units: frozenset[str]) -> PlanGraph:
        if units in recent:
            recent[units] = recent.pop(units)  # the most recently used last: the least recently used goes first
        else:
            if len(recent) >= RECENT_TABLES:
                recent.pop(next(iter(recent)))
            recent[units] = search.table(cap, mesh, units, work)
            least[units], enough[units] = least_memory(recent[units]), enough_memory(recent[units])
        return recent[units]

    def fits(units: frozenset[str]) -> bool:
        if units not in least:
            table(units)
        return budget is None or least[units] <= budget

    def bounded(g: PlanGraph) -> Pruned | None:
        """``Pruned`` when the lower bound of ``g``'s unbudgeted problem reaches the incumbent."""
        if (c := cut_of(incumbent, objective)) is None:
            return None
        if floor is not None:  # the plain table's solve bound: never below the cheap bound of the same table
            return Pruned(floor, c) if floor >= c else None
        p = to_problem(g, objective)
        return Pruned(bound, c) if (bound := lower_bound(reduce(p, argmins=False), p)) >= c else None

    chains = recompute_choices(cap)
    plain = table(frozenset())
    if (p := bounded(plain)) is not None:
        raise p  # recomputing anything only adds time to every plan of this mesh
    if budget is not None and floor is None:
        got = _solve_free(plain, search, cut_of(incumbent, objective))
        if got.memory <= budget:
            return got  # the fastest plan of every choice, and it fits
        floor, free = got.solution.bound, got.solution.choice
    if budget is not None and (c := cut_of(incumbent, objective)) is not None and chains[0][-1]:
        if (p := budget_bound(plain, table(chains[0][-1]), objective, budget, c, free,
                                 floor if floor is not None else -math.inf)) is not None:
            raise p  # no recomputation choice fits a plan of this mesh that beats the cut

    def probes(on: Sequence[frozenset[str]]) -> tuple[Callable[[int], bool], Callable[[int], float | None]]:
        """``first_fitting``'s two questions about chain ``on``'s choices."""
        return (lambda i: fits(on[i])), (lambda i: least.get(on[i]))

    misfits: list[MemoryBudgetError] = []
    starts: list[list[frozenset[str]]] = []
    misfit: list[frozenset[str]] = []  # choices known not to fit
    for chain, ks in zip(chains, chain_counts(cap, chains)):
        # Rerunning a subset of a choice's units keeps at least its memory: no choice of a chain inside one that
        # cannot fit can (``C_k`` inside ``B_0``, every attention: known from ``B``'s bisection, no table built).
        if any(chain[-1] <= u for u in misfit):
            continue
        if not fits(chain[-1]):
            misfits.append(MemoryBudgetError(enough[chain[-1]], mesh))
            misfit.append(chain[-1])
            continue
        lo = 0 if budget is None else first_fitting(ks, *probes(chain), budget)
        if lo > 0:
            misfits.append(MemoryBudgetError(enough[chain[lo - 1]], mesh))
            misfit.append(chain[0])  # least memory only shrinks along a chain: its first cannot fit either
        starts.append(chain[lo:])
    return chain_search(cap, mesh, search, starts, table, incumbent, say, floor, misfits)


def first_fitting(ks: Sequence[int], fits: Callable[[int], bool], known: Callable[[int], float | None],
                  budget: float) -> int:
    """The first index of a chain whose choice can fit ``budget``, the last one's being known to (least memory only
    shrinks along a chain, so the choices that can fit are a tail of it): ``fits(i)`` builds choice ``i``'s table
    to tell, ``known(i)`` its least memory where a table told it already (None: not yet).

    Each probe is where the line through the least memories known at the two ends of the interval left (the last
    choice known not to fit, the first known to) crosses the budget, at ``ks`` (each choice's layers), and then its
    neighbour on the other side: each layer recomputed frees about one layer's activations, so the line is nearly
    exact and two tables settle a chain that bisection takes five for (the last four of 31 fit Llama-3-8B at
    batch 16 x 8K on 8 devices).  A round that does not halve the interval is followed by one at its middle, so
    no chain takes more than about twice bisection's probes."""
    lo, hi = 0, len(ks) - 1  # every choice below lo cannot fit; hi can

    def guess() -> int | None:
        left = lo - 1 if lo > 0 else lo
        a, b = known(left), known(hi)
        if a is None or b is None or a <= b or a <= budget:
            return None
        at = ks[left] + (a - budget) / (a - b) * (ks[hi] - ks[left])  # the line's crossing, in layers
        return min(max(next((i for i in range(lo, hi) if ks[i] >= at), hi - 1), lo), hi - 1)

    halve = False
    while lo < hi:
        width, i = hi - lo, None if halve else guess()
        if i is None:  # no line yet (or the last one missed): bisection
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        elif fits(i):  # then the choice before it, which the line says cannot fit
            lo, hi = (i, i) if i == lo or not fits(i - 1) else (lo, i - 1)
        else:  # then the choice after it, which the line says can
            lo = i + 1
            if lo < hi:
                lo, hi = (lo, lo) if fits(lo) else (lo + 1, hi)
        halve = i is not None and not halve and 2 * (hi - lo) > width
    return lo


def chain_search(cap: Captured, mesh: Mesh, search: Search, chains: Sequence[Sequence[frozenset[str]]],
                 table: Callable[[frozenset[str]], PlanGraph], incumbent: Incumbent = None,
                 say: Callable[[str], None] = lambda line: None, floor: float | None = None,
                 misfits: Sequence[MemoryBudgetError] = ()) -> Result:
    """The best plan over the recomputation choices of ``chains`` (each a run of choices that can all fit, in
    chain order), by best-first branch and bound on stretches of a chain.

    The first chain's first and last choices are solved first (plans to prune by), each also priced with fewer
    layers recomputed (``shift``).  Then a stretch ``[a, b]`` of a chain is bounded at once by
    ``search.chain.stretch_bound`` (from the duals of its two ends under the budget, an end whose tied problem differs
    in shape peeled off and bounded by its own dual: ``search.chain.pieces``; ``floor``, the plain table's bound,
    bounds every choice), a single choice by its own dual, and the region with the lowest bound is taken next: first
    its bound is tightened (``search.chain.tighten``: more multipliers) towards what would prune it; if it still
    cannot be pruned, a single choice is solved exactly (``solve_table_on``) and a stretch is split at its
    middle choice, whose dual is checked to lie on the line of its ends' (``search.chain.affine``: a chain that
    fails loses its stretch bounds, and every stretch of it is searched again choice by choice).  The search ends
    when the lowest bound left is within ``gap`` of the best plan (or reaches the incumbent: another mesh's plan is
    better), or ``time_limit_s`` after it began (each solve gets what is left, at least a second); the result's
    bound is the least of its own and every region left or pruned.  ``Pruned`` when every region reaches the
    incumbent."""
    import heapq

    from ..search.chain import MULTIPLIERS, Dual, affine, pieces as stretch_pieces, pieces_bound, tighten

    objective, budget, gap = search.options.objective, search.memory_bytes, search.options.gap
    counts = chain_counts(cap, chains)  # each choice's k
    duals: dict[tuple[int, int], Dual] = {}
    repeats: dict[frozenset[str], list[Run]] = {}  # each choice's repeated layers (``runs_of``)
    broken: set[int] = set()  # chains whose tied problems were found not affine in k
    given_up: list[tuple[int, int, int]] = []  # stretches pruned on stretch bounds (searched again if broken)
    solved: set[tuple[int, int]] = set()
    best: Result | None = None
    lowest = math.inf  # the least bound of every region pruned or solved
    failed: list[MemoryBudgetError] = list(misfits)
    pruned: Pruned | None = None
    stopped = False  # the time limit ended the search
    scale = 0.0  # the multipliers' scale: a step time
    firsts: dict[int, PlanGraph] = {}  # each chain's first choice's table, kept for ``shift`` past ``table``'s few
    tally = [0, 0]  # single choices whose own dual pruned them, and those solved after it did not
    frees: dict[frozenset[str], float] = {}  # bounds without the budget of the choices bounded or solved so far
    layers: dict = {}  # reductions of layers by content, shared by the choices' duals and free bounds (reduce_tied)

    def free_floor(units: frozenset[str]) -> float:
        """The best bound without the budget of a choice that ``units`` reruns at least the ops of
        (``reruns_within``): recomputation only adds time (``solve_recompute``), so every plan of ``units`` costs at
        least it, whatever its memory.  A stretch of a chain reruns at least its first choice's ops."""
        return max((f for u, f in frees.items() if reruns_within(u, units)), default=-math.inf)

    def free_of(c: int, i: int, target: float) -> float:
        """``free_floor`` of choice ``i`` of chain ``c``, and where that is below ``target`` and the choice has no
        free bound of its own yet, its own (``problem.free_bound``: one reduction of its tied problem, no LP).  Where
        the fastest plans of the choices past the first that fits have room under the budget, this bound at
        multiplier 0 is the Lagrangian's best, and it prunes every choice that reruns more as well."""
        units = chains[c][i]
        got = free_floor(units)
        if got >= target or units in frees:
            return got
        frees[units] = free_bound(table(units), objective, runs_of(units), target, layers)
        return max(got, frees[units])

    def runs_of(units: frozenset[str]) -> list[Run]:
        """The repeated layers of a choice's table, found once for its dual and its solve."""
        if units not in repeats:
            repeats[units] = search.repeats(table(units))
        return repeats[units]

    def dual_of(c: int, i: int) -> Dual | None:
        if objective != "time":
            return None
        if (c, i) not in duals:
            units = chains[c][i]
            g = table(units)
            lams = np.array(MULTIPLIERS) * scale / budget if budget is not None else np.zeros(1)
            duals[(c, i)] = chain_dual(g, counts[c][i], runs_of(units), lams, budget or 0.0, layers)
        return duals[(c, i)]

    def pieces(c: int, a: int, b: int) -> list[list[Dual]]:
        """The duals that bound stretch ``[a, b]`` of chain ``c`` together (``search.chain.pieces``; none where the
        chain is broken: only ``floor`` bounds it)."""
        return [] if c in broken else stretch_pieces(a, b, lambda i: dual_of(c, i))

    def region_bound(c: int, a: int, b: int, target: float | None = None, known: float = -math.inf) -> float:
        """The bound of region ``[a, b]`` of chain ``c``, at least ``known`` (its parent stretch's) and ``floor``:
        a stretch of more than ``SHORT`` choices from the duals of its ends, tightened towards ``target``; a
        shorter one costs no reduction of its own; a single choice's own dual only where one was worked out (when
        ``target`` is given: ``single_bound``)."""
        base = max(floor if floor is not None else -math.inf, known, free_floor(chains[c][a]))
        if a == b:
            return max(base, duals[(c, a)].bound) if (c, a) in duals else base
        if target is not None and base < target:
            base = max(base, free_of(c, a, target))  # before the stretch's duals: it bounds the stretch if it prunes
        if b - a + 1 <= SHORT or (target is not None and base >= target):
            return base
        parts = pieces(c, a, b)
        if not parts:
            return base
        return max(base, pieces_bound(parts, target))

    def single_bound(c: int, i: int, target: float, known: float) -> tuple[float, bool]:
        """Choice ``i``'s bound before its solve, and whether its own dual was worked out or tightened for it:
        only while single choices' duals pay (``SINGLE_ODDS``), and only where ``known`` does not already reach
        ``target``."""
        got = region_bound(c, i, i, known=known)
        if got < target:  # its bound without the budget first: it prunes every choice that reruns more as well
            got = max(got, free_of(c, i, target))
        if got >= target or tally[1] > SINGLE_ODDS * tally[0] or dual_of(c, i) is None:
            return got, False
        return max(got, own(c, i, target)), True

    heap: list[tuple[float, int, int, int]] = []
    counted: set[tuple[int, int]] = set()  # choices whose solve's bound is counted in ``lowest``
    unbounded: list[tuple[float, int, int, int]] = []  # choices whose solve found no plan and no bound of its own

    def settle(left: list[tuple[float, int, int, int]], target: float) -> float:
        """The least bound of the regions ``left`` when the time limit stops the search (and of the choices whose
        solve found neither a plan nor a bound, at its end), each raised towards ``target`` by the duals it was
        pushed without (a stretch's ends tightened, a short stretch's or a single's choices each by its own), lowest
        first, for at most ``SETTLE_SHARE`` of the time limit more: a region is pushed with the bound its duals give
        at the first multipliers, and a choice solved up front has only the plain table's floor (Llama-3-70B on
        8x8x8, 512 devices: its every-layer choice's solve ran out of time, and the run's bound was that floor,
        4.634 s, beside a plan of 6.32 s whose choice's own dual is 6.31 s)."""
        until = time.perf_counter() + SETTLE_SHARE * search.options.time_limit_s
        got = math.inf
        for bound, c, a, b in sorted(left):
            if bound < target and math.isfinite(target) and time.perf_counter() < until:
                if b - a + 1 > SHORT and c not in broken:
                    bound = region_bound(c, a, b, target, bound)
                else:  # a choice solved already counts its solve's bound in ``lowest``
                    bound = min((max(bound, free_of(c, i, target), own(c, i, target)) for i in range(a, b + 1)
                                 if (c, i) not in counted), default=math.inf)
            got = min(got, bound)
        return got

    def own(c: int, i: int, target: float) -> float:
        """Choice ``i``'s own dual (``chain_dual``), tightened towards ``target``; -inf without one."""
        if (d := dual_of(c, i)) is None:
            return -math.inf
        return d.bound if d.bound >= target else max(d.bound, tighten([d], target))

    def aim() -> float:
        """What prunes a region now: the incumbent, or a bound within ``gap`` of this mesh's best plan."""
        other, mine = cut_of(incumbent, objective), best.value(objective) if best is not None else None
        return min(x for x in (other, mine * (1 - gap) if mine is not None else None, math.inf) if x is not None)

    def push(c: int, a: int, b: int, known: float = -math.inf) -> None:
        heapq.heappush(heap, (region_bound(c, a, b, known=known), c, a, b))

    def solve_choice(c: int, i: int, bound: float) -> None:
        nonlocal best, lowest, pruned
        solved.add((c, i))
        units = chains[c][i]
        limit = cut_of(incumbent, objective)
        if best is not None and objective == "time":
            limit = best.step_time_s if limit is None else min(limit, best.step_time_s)
        left = max(1.0, deadline - time.perf_counter())  # each solve gets what is left of the search's time
        within = replace(search, options=replace(search.options, time_limit_s=left))
        try:
            r = solve_table_on(table(units), within, limit, units, runs=runs_of(units))
        except MemoryBudgetError as e:
            failed.append(e)
            if budget is not None and least_memory(table(units)) <= budget:
                unbounded.append((bound, c, i, i))  # no plan found, yet some may fit: bounded at the end
            else:
                counted.add((c, i))
            return
        except Pruned as e:
            counted.add((c, i))
            lowest = min(lowest, max(bound, e.bound))
            pruned = pruned or e
            frees[units] = max(frees.get(units, -math.inf), e.free)
            return
        except SearchError:  # no plan found in time: bounded at the end, by its own dual
            unbounded.append((bound, c, i, i))
            return
        counted.add((c, i))
        lowest = min(lowest, max(bound, r.solution.bound))
        frees[units] = max(frees.get(units, -math.inf), r.solution.free)
        say(f"mesh {mesh}: recompute {len(units)} units: {r.value(objective):.4g} ({objective})")
        if best is None or r.value(objective) < best.value(objective):
            best = r
        if budget is not None and objective == "time":
            shift(c, i, r)

    def shift(c: int, i: int, r: Result) -> None:
        """``shift_one`` of ``r``'s plan, and of its solve's tied plan where a mix replaced it (``Solution.tied``:
        Mixtral-8x7B's tied plan of 16 layers recomputed shifts to 1,007.2 ms with 15, its mix to 1,008.4 ms)."""
        shift_one(c, i, r)
        if r.solution.tied is not None:
            shift_one(c, i, evaluate(r.graph, replace(r.solution, choice=list(r.solution.tied), tied=None)))

    def shift_one(c: int, i: int, r: Result) -> None:
        """A plan for free: ``r``'s tilings with fewer layers (on chain ``C``, attentions) recomputed, as many fewer
        as the memory it leaves under the budget pays for (each layer kept saves its rerun).  Every choice's table
        has the same variables and strategies (recomputation changes costs, not domains), so ``r``'s choice is a
        plan of each; its memory per layer is read off a second choice (a line: each layer kept adds its
        activations), and the plan is priced exactly on the choice it lands on, and kept when it fits and beats the
        best."""
        nonlocal best
        assert budget is not None
        k_of = {k: j for j, k in enumerate(counts[c])}
        k_here = counts[c][i]
        if r.memory >= budget or i == 0:
            return
        x = r.solution.choice

        def priced(j: int) -> Result | None:
            if j == 0 and c not in firsts:
                firsts[c] = table(chains[c][0])
            g = firsts[c] if j == 0 else table(chains[c][j])
            if len(g.vars) != len(x) or any(len(v.strategies) <= s for v, s in zip(g.vars, x)):
                return None
            return evaluate(g, Solution(list(x), 0.0, -math.inf, "feasible", 0.0, "shifted"))

        probe = priced(0)  # the chain's first choice: the fewest layers recomputed that can fit
        k_probe = counts[c][0]
        if probe is None or k_probe >= k_here:
            return
        per_layer = (probe.memory - r.memory) / (k_here - k_probe)  # bytes each layer kept adds
        if per_layer <= 0:
            return
        k = max(k_probe, k_here - int((budget - r.memory) // per_layer))
        for _ in range(SHIFT_TRIES):
            j = k_of.get(k)
            moved = probe if k == k_probe else priced(j) if j is not None else None
            if j is None or moved is None or k >= k_here:
                return
            if moved.memory <= budget:
                moved.solution = replace(moved.solution, objective=moved.step_time_s)
                moved.runs, moved.recompute = find_repeats(moved.graph), chains[c][j]
                say(f"mesh {mesh}: recompute {len(chains[c][j])} units (shifted): {moved.step_time_s:.4g} (time)")
                if best is None or moved.step_time_s < best.step_time_s:
                    best = moved
                return
            k += 1  # the line was optimistic here: one more layer recomputed

    deadline = time.perf_counter() + search.options.time_limit_s
    # Plans to prune by: the first chain's first choice (the least recomputed that can fit) and, where that choice
    # recomputes something or leaves no plan, its last (all of its layers, the least memory: the most room for a
    # fast tiling, shifted back to the budget by ``shift``: Mixtral-8x7B's best plan on 64 devices).  Where nothing
    # recomputed fits, the last is searched with the rest, bounded before it is solved: the budget's plans mixed
    # layer by layer (``tying.mix_layers``) put the first choice's plan near its own bound, and a last choice solved
    # first cost Llama-3-70B on 8x4x2 (64 devices) its whole time limit for a plan 10% slower.
    start = floor if floor is not None else -math.inf
    ends = [0] if chains else []
    if chains:
        solve_choice(0, 0, start)
        if (best is None or chains[0][0]) and len(chains[0]) > 1:
            solve_choice(0, len(chains[0]) - 1, start)
            ends.append(len(chains[0]) - 1)
    scale = best.step_time_s if best is not None else floor if floor is not None and math.isfinite(floor) else 0.0
    if scale <= 0.0:  # else the plain table's bound
        p = to_problem(table(frozenset()), "time")
        scale = max(lower_bound(reduce(p, argmins=False), p), 1e-30)
    for c, chain in enumerate(chains):
        if c == 0 and len(chain) > len(ends):
            push(c, 1, len(chain) - len(ends))
        elif c > 0:
            push(c, 0, len(chain) - 1)
    while heap:
        bound, c, a, b = heapq.heappop(heap)
        other = cut_of(incumbent, objective)
        mine = best.value(objective) if best is not None else None
        target = aim()
        consulted = False  # a single choice's own dual worked out for it
        if target < math.inf and a == b and (c, a) not in solved:
            bound, consulted = single_bound(c, a, target, bound)
        elif target < math.inf:
            bound = region_bound(c, a, b, target, bound)
        if other is not None and bound >= other:
            pruned, lowest = Pruned(bound, other), min(lowest, bound)
            tally[0] += consulted
            continue
        if mine is not None and (bound >= mine or relative_gap(mine, bound) <= gap):
            tally[0] += consulted
            lowest = min(lowest, bound)
            if c not in broken:  # a bound that may be a stretch's (a single inherits its parent's)
                given_up.append((c, a, b))
            continue
        if time.perf_counter() > deadline:
            lowest = min(lowest, settle([(bound, c, a, b), *heap], target))
            say(f"mesh {mesh}: recomputation search stopped at its time limit, bound {lowest:.4g}")
            stopped = True
            break
        if a == b:
            if (c, a) not in solved:  # the middle of two stretches is reached from both
                tally[1] += consulted
                solve_choice(c, a, bound)
            continue
        if c in broken or b - a + 1 <= max(SHORT, 2):  # (two choices: no middle to split at)
            for i in range(a, b + 1):
                push(c, i, i, bound if c not in broken else -math.inf)
            continue
        m = (a + b) // 2
        line = next((ds for ds in pieces(c, a, b) if len(ds) == 2), None)  # the bound assumed it: checked at m
        dm = dual_of(c, m)
        if line is not None and dm is not None and line[0].k < dm.k < line[1].k and not affine(line[0], dm, line[1]):
            broken.add(c)  # this chain's stretch bounds were not exact: search it choice by choice
            say(f"mesh {mesh}: recomputation chain {c} is not affine in its layers: searched choice by choice")
            for cc, aa, bb in [r for r in given_up if r[0] == c] + [(c, a, b)]:
                for i in range(aa, bb + 1):
                    push(cc, i, i)
            given_up = [r for r in given_up if r[0] != c]
            continue
        push(c, a, m, bound)
        push(c, m, b, bound)
    if unbounded:  # each by its own dual, towards what would prove the plan (or prune the mesh)
        lowest = min(lowest, settle(unbounded, aim()))
    if best is None:
        if pruned is not None and not stopped and lowest >= pruned.cutoff:  # every region reached the incumbent
            raise Pruned(lowest if lowest < math.inf else pruned.bound, pruned.cutoff)
        cut = cut_of(incumbent, objective)
        if cut is not None and not stopped and cut <= lowest < math.inf:  # ... by bounds no region raised it with
            raise Pruned(lowest, cut)
        if stopped:  # choices that could fit were left unsearched: not a misfit, and their bound must be counted
            raise SearchStopped(mesh, lowest)
        if failed:
            raise min(failed, key=lambda e: e.least)
        raise SearchError(f"no plan found on mesh {mesh} with any recomputation in the time limit")
    if objective == "time" and (lowest < best.solution.bound or best.solution.solver == "shifted"):
        t = best.step_time_s
        status = best.solution.status if relative_gap(t, lowest) <= gap else "feasible"
        best.solution = replace(best.solution, bound=min(lowest, t), status=status)
    return best


# Tables of one mesh's recomputation choices kept for reuse (the bisection's probes, the solves, the duals and
# ``shift`` return to a few choices; one Llama-3-70B table on a 3-axis mesh took 3 s to build again).  Eight, not
# four: Llama-3-8B at batch 8 x 128K on 64 devices built 351 tables where it built 380 (28 -> 20 s of rebuilds), at
# the same peak memory (3.06 GB, 3.03 before, in one process): the tables of one mesh share most of their arrays.
RECENT_TABLES = 8
# The share of ``time_limit_s`` a recomputation search stopped by it spends more raising the bounds of the regions it
# left (``chain_search``'s ``settle``): bounds only, no solve.
SETTLE_SHARE = 0.25
# Choices ``chain_search``'s ``shift`` prices at most per plan, from the fewest layers recomputed the line allows.
SHIFT_TRIES = 3
# A single choice's own dual (a table, and a reduction of its tied problem per multiplier: ``search.chain.tighten``)
# is worked out before its solve only while this search's singles' duals missed at most this many times for each
# single one pruned; past that a single is solved, bounded by its parent stretch's bound alone (the solve's own
# Lagrangian under the cut reaches at least as high: it prunes the choice as soon as a bound reaches the cut).  The
# two cases measured: Llama-3-8B at batch 16 x 8K on 8 devices (fp32, 80 GB), where no single's dual pruned it and
# each cost more than its solve, and 8 x 128K on 64 devices, where the singles of every 3-axis mesh were pruned by
# their duals without one solve.  Counts, not a clock: plans never vary by run.
SINGLE_ODDS = 2
# Stretches of at most this many choices get no stretch bound of their own (two end duals, each tightened): they
# are searched choice by choice, each single keeping its parent's bound.  A stretch of two choices is bounded by the
# least of two singles' duals, so its tightening is theirs, twice; at three or four the two ends' tightenings cost as
# much as their singles' duals.
SHORT = 4


def cut_of(incumbent: Incumbent, objective: str) -> float | None:
    """The incumbent's value now, when it bounds ``objective`` (step time only)."""
    return now(incumbent) if objective == "time" else None


# Multipliers (as multiples of cut / budget: seconds per byte) at which ``budget_bound`` tries the Lagrangian bound.
BOUND_MULTIPLIERS = (0.5, 2.0, 8.0)


def budget_bound(plain: PlanGraph, least: PlanGraph, objective: str, budget: float, cut: float,
                 known: Sequence[int] | None = None, at_zero: float = -math.inf) -> Pruned | None:
    """``Pruned`` when no recomputation choice on this mesh has a plan within ``budget`` that beats ``cut``.

    Every choice ``A`` and tiling ``x`` cost at least what nothing recomputed costs (``plain``: recomputation only
    adds time) and keep at least what every layer recomputed keeps (``least``, the last choice of the chains:
    memory shrinks as the recomputed set grows).  So for any ``lam >= 0``, by weak duality,

        min_{x, A: M(x, A) <= B} T(x, A)  >=  min_x T_plain(x) + lam * (M_least(x) - B),

    an unbudgeted problem over the plain table's costs with ``lam`` times the other table's memory added, whose
    ``search.lower_bound`` is a bound of every choice at once: one cheap bound per multiplier
    (``BOUND_MULTIPLIERS``) instead of a search over the choices.  None when no multiplier reaches the cut (or
    the two tables do not line up).

    A plan ``known`` (a choice of either table) whose memory on ``least`` fits caps every multiplier's bound:
    ``F(lam) <= T_plain(known) + lam * (M_least(known) - B) <= T_plain(known)``; when that is below the cut no
    multiplier can prune, and none is tried (each a reduction of the whole untied table: 6-7 s on a 3-axis mesh of
    64 devices at 128K tokens, where every one of them fell below the plain table's own bound).  The multipliers
    are tried in increasing order and stop once a bound falls below the one before (the first below ``at_zero``,
    a bound of ``F(0)``: the plain table's): ``F`` is concave in ``lam``, so past its peak it only falls (the
    bounds tried are below ``F``, so this may stop early: it costs pruning, never a plan).  At 128K tokens on a
    3-axis mesh of 64 devices the first multiplier's bound fell below the plain table's: one reduction, not three."""
    if (pq := lined_up(plain, least, objective, budget)) is None:
        return None
    if known is not None and (top := bound_cap(plain, least, objective, budget, known, pq)) is not None and top < cut:
        return None
    last = at_zero
    for f in BOUND_MULTIPLIERS:
        bound = recompute_bound(plain, least, objective, budget, f * cut / budget, pq)
        if bound is None:
            return None
        if bound >= cut:
            return Pruned(bound, cut)
        if bound < last:  # past the peak of a concave dual: larger multipliers only bound lower
            return None
        last = bound
    return None


def lined_up(plain: PlanGraph, least: PlanGraph, objective: str, budget: float) -> tuple[Problem, Problem] | None:
    """The plain table's problem and the every-layer-recomputed table's under ``budget``, which ``bound_cap`` and
    ``recompute_bound`` read together; None when their variables' strategies do not line up.  ``budget_bound``
    builds them once for all its multipliers."""
    p = to_problem(plain, objective)
    q = to_problem(least, objective, budget)
    assert q.memory is not None and q.budget is not None
    return (p, q) if [u.shape for u in p.unary] == [m.shape for m in q.memory] else None


def bound_cap(plain: PlanGraph, least: PlanGraph, objective: str, budget: float, x: Sequence[int],
              problems: tuple[Problem, Problem] | None = None) -> float | None:
    """``T_plain(x)``, above ``recompute_bound`` at every multiplier, when plan ``x`` fits ``budget`` with ``least``'s
    memory (``budget_bound``); None when it does not fit or is not a plan of both tables.  ``problems``: the two
    tables' ``lined_up`` problems, when the caller built them."""
    if (pq := problems or lined_up(plain, least, objective, budget)) is None:
        return None
    p, q = pq
    assert q.memory is not None and q.budget is not None
    if len(x) != p.n or any(not 0 <= s < len(u) for s, u in zip(x, p.unary)):
        return None
    return p.evaluate(list(x)) if q.memory_of(list(x)) <= q.budget else None


def recompute_bound(plain: PlanGraph, least: PlanGraph, objective: str, budget: float, lam: float,
                    problems: tuple[Problem, Problem] | None = None) -> float | None:
    """``budget_bound``'s lower bound at multiplier ``lam`` (None when the two tables do not line up).
    ``problems``: as ``bound_cap``'s."""
    if (pq := problems or lined_up(plain, least, objective, budget)) is None:
        return None
    p, q = pq
    assert q.memory is not None and q.budget is not None
    r = Problem([u + lam * m for u, m in zip(p.unary, q.memory)], p.edges, None, None, p.names, p.blocks)
    return lower_bound(reduce(r, argmins=False), r) - lam * q.budget


def budget_hints(cap: Captured, model: torch.nn.Module | None, example_inputs: Any, example_kwargs: Any,
                 search: Search, meshes: Sequence[Mesh], recompute: str) -> list[str]:
    """The options under which some plan on ``meshes`` fits ``search.memory_bytes`` where the given ones fit
    none: ``--recompute auto`` (when recomputation was not already free to choose; every layer recomputed is
    the least memory it reaches), ``--precision bf16-mixed`` (an fp32 model captured again under it, with
    recomputation as given or free), each checked by the memory the tables' errors name (``enough_memory``, which
    some plan fits), never guessed.  Run only on the way to the error."""
    budget = search.memory_bytes
    if budget is None:
        return []

    def fits(c: Captured, units: frozenset[str]) -> bool:
        return any(enough_memory(search.table(c, m, units)) <= budget for m in meshes)

    hints: list[str] = []
    full = recompute_units(cap, "layers")
    free = recompute in ("auto", "layers") or not full
    if not free and fits(cap, full):
        hints.append("--recompute auto")
    if cap.precision == "fp32" and model is not None and not hints:
        args, kwargs = split_example(example_inputs, example_kwargs)
        half = capture(model, args, kwargs, precision="bf16-mixed")
        if fits(half, recompute_units(half, "layers" if free else recompute)):
            hints.append("--precision bf16-mixed")
        elif not free and fits(half, recompute_units(half, "layers")):
            hints.append("--precision bf16-mixed --recompute auto")
    return hints
