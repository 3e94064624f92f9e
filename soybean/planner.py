"""The planning pipeline: capture -> annotate/enumerate -> cost -> solve -> Plan.

``plan`` runs it for every candidate mesh shape (the factorisations of the
device count into 1-3 axes, unless a mesh is given) and keeps the cheapest
under the objective; it also prices the baselines a practitioner would choose
(data parallel, model parallel, FSDP, TP x FSDP, Megatron TP x DP), each the
same table restricted and solved the same way (``soybean.baselines``).
``mode="dp" | "mp"`` forces the first two's layouts on the plan itself.
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from . import route_cache
from .baselines import batch_split, model_parallel_domains, price as price_baselines
from .capture import Captured, CaptureError, capture, split_example
from .cost.memory import GIB, budget_bytes, budget_needed
from .cost.pricing import PricingCache
from .cost.profiles import Profile, load_profile
from .graph import (
    NoStrategyLeft,
    PlanGraph,
    SharedWork,
    attention_units,
    build,
    gc_paused,
    layer_of,
    phase_memory,
    phase_peaks,
    recomputable_layers,
)
from .ir.algorithms import check as check_algorithm
from .mesh import Mesh, factorizations
from .mesh_pool import FEW_PER_WORKER, default_jobs, each_mesh
from .options import PlanOptions, options as merge_options, plan_kind
from .plan import Plan
from .precision import policy
from .records import context_parallel_records, layer_rows, memory_breakdown, moe_records, reshard_records
from .rules.datadep import data_dependent_warning
from .search import Pruned, Run, SearchError, Solution, find_repeats, relative_gap, solve, to_problem
from .search.problem import Problem, lower_bound, reduce
from .tiling import R

# ``replicated``: the optimum with every parameter stored whole on every device (its use still split where that
# pays), as the torch.compile backend runs plans on the user's own parameters (``soybean.compile``).


@dataclass
class Result:
    graph: PlanGraph
    solution: Solution
    comm_bytes: float
    comm_s: float
    compute_s: float
    memory: float
    hidden_s: float = 0.0      # gradient-sync time overlapped with backward compute
    sync_s: float = 0.0        # all gradient-sync time (part of comm_s)
    runs: list[Run] = field(default_factory=list)  # the repeated layers solved tied
    recompute: frozenset[str] = frozenset()  # the units whose forward reruns in backward
    cap_s: float = 0.0         # the most gradient-sync time backward can hide: BACKWARD_SHARE * op compute
    peak_mu: float | None = None  # the cap search's member of the best bound (``capped_overlap``), if it ran

    @property
    def step_time_s(self) -> float:
        return self.comm_s + self.compute_s - self.hidden_s

    def value(self, objective: str) -> float:
        return self.comm_bytes if objective == "comm" else self.step_time_s


def _domains(cap: Captured, mesh: Mesh, mode: str, local_batch: bool = False) -> dict[str, list[tuple]]:
    """The placeholder restrictions of a forced ``mode`` (the layouts of two baselines, ``soybean.baselines``)
    and of the ``local_batch`` contract (every input split on dim 0 over the whole mesh)."""
    if local_batch and mode == "mp":
        raise ValueError(
            "local_batch splits the inputs by batch, the model-parallel baseline replicates them: use mode auto or dp"
        )
    doms = batch_split(cap, mesh) if local_batch else {}
    if mode == "dp":
        doms.update({fqn: [(R,) * mesh.ndim] for fqn in cap.params.values()})
        doms.update(batch_split(cap, mesh))
    elif mode == "mp":
        doms.update(model_parallel_domains(cap, mesh))
    elif mode == "replicated":
        doms.update({fqn: [(R,) * mesh.ndim] for fqn in cap.params.values()})
    return doms


@dataclass(frozen=True)
class Search:
    """How one planner run solves each mesh: its ``PlanOptions`` (objective, solver, mode, contract, time limit,
    topology, tying, gap: each read from there, never restated), the profile they name, loaded and restricted to
    the allowed collectives, the budget in bytes (``cost.memory.budget_bytes`` of ``memory_gb``), and the run's
    ``cost.pricing.PricingCache``, shared by every table the run builds (each mesh, each recomputation choice, the
    baselines) and dropped with it."""

    profile: Profile
    options: PlanOptions = PlanOptions()
    memory_bytes: float | None = None
    pricing: PricingCache = field(default_factory=PricingCache, repr=False, compare=False)
    # the profile on each mesh (``Profile.on_mesh``: which axes cross nodes), worked out once per mesh
    placed: dict[Mesh, Profile] = field(default_factory=dict, repr=False, compare=False)
    # the last cap search's peak member (``Result.peak_mu``), where the next mesh's starts (``capped_overlap``)
    peaks: list[float] = field(default_factory=list, repr=False, compare=False)

    def on_mesh(self, mesh: Mesh) -> Profile:
        """The run's profile on ``mesh`` (``Profile.on_mesh`` with the run's ``gpus_per_node``)."""
        if mesh not in self.placed:
            self.placed[mesh] = self.profile.on_mesh(mesh, self.options.gpus_per_node)
        return self.placed[mesh]

    def table(self, cap: Captured, mesh: Mesh, recompute: frozenset[str] = frozenset(),
              work: SharedWork | None = None) -> PlanGraph:
        """The candidate table of ``cap`` on ``mesh`` that ``solve_on`` solves (``work``: ``graph.SharedWork`` of
        the tables of other recomputation choices on ``mesh``)."""
        o = self.options
        try:
            return build(cap, mesh, self.on_mesh(mesh), objective=o.objective,
                         domains=_domains(cap, mesh, o.mode, o.local_batch), pin_params=o.mode in ("dp", "mp"),
                         local_outputs=o.local_batch, divide_work=True if o.mode in ("dp", "mp") else None,
                         recompute=recompute, pricing=self.pricing, work=work, context_parallel=o.context_parallel,
                         context_parallel_method=o.context_parallel_method)
        except NoStrategyLeft as e:  # an option rules this mesh out
            raise SearchError(str(e)) from e


# The best step time another mesh reached: a number, or read live when called (``mesh_pool``: another worker's
# better plan prunes this mesh's search while it runs), or None.
Incumbent = float | Callable[[], float | None] | None


def now(incumbent: Incumbent) -> float | None:
    """The incumbent's value at this moment."""
    return incumbent() if callable(incumbent) else incumbent


def solve_on(cap: Captured, mesh: Mesh, search: Search, incumbent: Incumbent = None,
             recompute: frozenset[str] = frozenset()) -> Result:
    """Build the candidate table on ``mesh`` and solve it (``SearchError`` when no plan fits).  ``incumbent``:
    the best step time another mesh reached: a mesh whose cheap lower bound (``search.lower_bound``) reaches it
    is not solved (``search.Pruned``), and one whose solve's bound reaches it is not refined."""
    return solve_table_on(search.table(cap, mesh, recompute), search, incumbent, recompute)


def solve_table_on(g: PlanGraph, search: Search, incumbent: Incumbent = None,
                   recompute: frozenset[str] = frozenset(), settle: Callable[[Result], bool] | None = None) -> Result:
    """``solve_on``'s solve of a table already built (``MemoryBudgetError`` when no plan of it fits).  ``settle``:
    when it holds for member 0's plan (``capped_overlap``), that plan is returned as it is, its bound still a lower
    bound of every plan of ``g``."""
    objective, solver, memory_bytes = search.options.objective, search.options.solver, search.memory_bytes
    least = least_memory(g)
    if memory_bytes is not None and least > memory_bytes:
        raise MemoryBudgetError(least, g.mesh)
    runs = find_repeats(g) if search.options.tie_layers and solver != "brute" else []

    def solved(mu: float = 0.0, phase: str = "activations", cutoff: float | None = None,
               enough: float | None = None) -> Result:
        ov = (1.0 - mu) * g.profile.grad_overlap
        problem = to_problem(g, objective, memory_bytes, overlap=ov, phase=phase, compute_credit=mu * BACKWARD_SHARE)
        r = evaluate(g, solve(problem, solver, search.options.time_limit_s, search.options.gap, runs, cutoff=cutoff,
                              enough=enough))
        r.runs, r.recompute = runs, recompute
        return r

    # The budget binds the activations phase; a plan whose gradients phase breaks it is replaced by the best plan
    # with both phases summed (an upper bound of the larger).  Only the activations phase's solves bound the step:
    # the sum is a stricter budget than the peak's (a plan may fit the peak and not the sum), so its solves' bounds
    # and cutoffs hold for its plans only, and the result keeps the activations phase's bound (measured: a
    # 10-layer transformer, every layer recomputed, reported "optimal" at 70.4 ms under the sum where a plan of
    # 55.2 ms fits).
    r = solved(cutoff=now(incumbent))
    if memory_bytes is None or r.memory <= memory_bytes:
        if objective != "time" or (settle is not None and settle(r)):
            return r
        return _peaked(search, capped_overlap(r, lambda mu, cut, need: solved(mu, "activations", cut, need),
                                              search.options.gap, incumbent, _hint(search)))
    relaxed = r.solution.bound  # below every plan that fits: the activations phase alone is a relaxation
    try:  # a sum solve's bound that reaches the incumbent says only that no plan of the sum's can beat it
        r = solved(phase="sum", cutoff=now(incumbent))
    except Pruned as e:
        raise SearchError(f"mesh {g.mesh}: no plan within the budget in both phases at once beats {e.cutoff:.4g}; "
                          f"the step's bound is {relaxed:.4g}") from None
    if objective == "time" and not (settle is not None and settle(r)):
        try:
            r = _peaked(search, capped_overlap(r, lambda mu, cut, need: solved(mu, "sum", cut, need),
                                               search.options.gap, incumbent, _hint(search)))
        except Pruned:
            pass  # the sum's members cannot beat the incumbent: its first plan stands, with the bound below
    t = r.solution.objective if objective != "time" else r.step_time_s
    bound = min(relaxed, r.solution.bound, t)
    status = r.solution.status if relative_gap(t, bound) <= search.options.gap else "feasible"
    r.solution = replace(r.solution, bound=bound, status=status)
    return r


# The most Lagrangian members ``capped_overlap`` solves after the first.
OVERLAP_STEPS = 6
# Members closer than this are met again: their problems differ by ``MU_MET * (o S - b K)`` per plan, below the
# gaps searched (Llama-3-8B on 8x4x2: the crossing landed 1.5e-6 from the member before it, and solved it again).
MU_MET = 1e-4


def _hint(search: Search) -> float | None:
    return search.peaks[-1] if search.peaks else None


def _peaked(search: Search, r: Result) -> Result:
    """``r``, its cap search's peak kept in ``search.peaks`` for the next mesh's."""
    if r.peak_mu is not None:
        search.peaks.append(r.peak_mu)
    return r


def capped_overlap(first: Result, solved: Callable[[float, float | None, float], Result], gap: float,
                   incumbent: Incumbent = None, hint: float | None = None) -> Result:
    """The best plan under the capped overlap, with a lower bound of it.

    The step time is ``T(x) = L(x) - min(o S(x), b K(x))``: ``L`` the seconds with nothing hidden, ``S`` the
    deferred gradient syncs, ``K`` the ops' compute, ``o`` the profile's ``grad_overlap``, ``b`` ``BACKWARD_SHARE``
    (``evaluate``).  ``min`` is not linear, but for every ``mu`` in [0, 1], ``min(o S, b K) <= (1 - mu) o S + mu b K``,
    so the linear problem ``T_mu(x) = L(x) - (1 - mu) o S(x) - mu b K(x)`` (``to_problem``'s ``overlap`` and
    ``compute_credit``) is below ``T`` everywhere, and its solve's bound is a lower bound of ``min T`` (weak
    duality): the dual ``D(mu) = min_x T_mu(x)`` is concave, each plan ``x`` a line of it.  ``first`` is member 0
    (all of the sync credited); when its plan hides all it is credited with (``o S <= b K``) it is optimal as it
    stands.  Otherwise member 1 follows, then the member where the lines of the last plan on either side of the
    dual's peak (slope ``o S - b K`` above and below 0) cross (Kelley's cutting planes in one dimension: a plan
    found again, or a member met again (within ``MU_MET``), ends it), each plan priced exactly and the best kept,
    until the best plan is within ``gap`` of the best bound or ``OVERLAP_STEPS`` members; ``Pruned`` once the
    bound reaches ``incumbent`` (another mesh is better; read before each member).  Each member is told the bound
    that would prove the best plan so far within ``gap`` (``search.solve``'s ``enough``): a member whose rounded
    LP plan is below it keeps its LP bound, since no branch and bound of it could prove that.  ``hint``: a member
    in (0, 1) tried before member 1 (another mesh's peak: Llama-3-8B's 3-D meshes peak near 0.64 alike); when the
    dual still rises there, member 1 follows.  It moves only where the search starts: each bound is still a bound
    and each plan priced exactly (16x8x8: 3 members, not 6, the same plan and bound).  The result's ``solution``
    carries ``T`` of its plan as objective and the best bound, its ``peak_mu`` the member of that bound."""
    o = first.graph.profile.grad_overlap

    def line(r: Result) -> tuple[float, float]:  # T_mu of r's plan = a + mu * slope
        a = r.comm_s + r.compute_s - o * r.sync_s
        return a, o * r.sync_s - r.cap_s

    best, bound, peak = first, first.solution.bound, 0.0
    lo, hi = line(first), None
    if lo[1] > 0:
        seen = {tuple(first.solution.choice)}
        mu, tried = (hint if hint is not None and 0.0 < hint < 1.0 else 1.0), {0.0}
        for _ in range(OVERLAP_STEPS):
            if any(abs(mu - t) <= MU_MET for t in tried):
                break  # the same member again (up to rounding): the same problem, the same plan and bound
            tried.add(mu)
            cut = now(incumbent)
            if cut is not None and bound >= cut:
                raise Pruned(bound, cut)
            if relative_gap(best.step_time_s, bound) <= gap:
                break
            try:
                r = solved(mu, cut, best.step_time_s * (1.0 - gap))
            except Pruned as e:  # this member's bound already reaches the incumbent: so does T's
                raise Pruned(max(bound, e.bound), cut if cut is not None else e.bound) from None
            if r.solution.bound > bound:
                bound, peak = r.solution.bound, mu
            best = min(best, r, key=lambda x: x.step_time_s)
            key = tuple(r.solution.choice)
            if key in seen and hi is not None:
                break  # found again where two lines cross: the envelope of the plans found is the dual at its peak
            seen.add(key)
            a, slope = line(r)
            if slope > 0:
                lo = (a, slope)
            else:
                hi = (a, slope)
            if hi is None:
                if mu < 1.0:
                    mu = 1.0  # the dual still rises at the hint: member 1 next
                    continue
                break  # the dual rises all the way to member 1: its bound is the dual's best
            mu = min(1.0, max(0.0, (hi[0] - lo[0]) / (lo[1] - hi[1])))  # where the two lines cross
    t, bound = best.step_time_s, min(bound, best.step_time_s)
    status = best.solution.status if relative_gap(t, bound) <= gap else "feasible"
    best.solution = replace(best.solution, objective=t, bound=bound, status=status)
    best.peak_mu = peak if lo[1] > 0 else None
    return best


def recompute_units(cap: Captured, recompute: str) -> frozenset[str]:
    """The units a fixed ``recompute`` choice reruns (``none``, ``layers``, ``attention``)."""
    units: dict[str, Callable[[Captured], Sequence[str]]] = {
        "none": lambda c: (), "layers": recomputable_layers, "attention": attention_units}
    return frozenset(units[recompute](cap))  # only the one asked for: each reads every node's op


def recompute_choices(cap: Captured) -> list[list[frozenset[str]]]:
    """The recomputation choices ``solve_recompute`` searches, as chains along which the step time can only
    grow: ``A_k``, the first ``k`` recomputable layers (graph order) recomputed whole; ``B_k``, the same with
    every other layer's attention recomputed (selective recomputation, where the layers have one).  ``k = 1``
    is left out: a role's single recomputed unit keeps its whole activations as its rerun buffer, so it never
    saves memory over ``k = 0`` and only adds time."""
    layers = recomputable_layers(cap)
    att = {layer_of(u): u for u in attention_units(cap)}
    ks = [k for k in range(len(layers) + 1) if k != 1]
    chains = [[frozenset(layers[:k]) for k in ks]]
    if att:
        chains.append([frozenset(layers[:k]) | {att[x] for x in layers[k:] if x in att} for k in ks[:-1]])
    return chains


def layers_in(units: frozenset[str], layers: Collection[str]) -> int:
    """How many whole layers a recomputation choice reruns: the ``k`` of ``A_k`` and ``B_k``."""
    return sum(1 for u in units if u in layers)


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
                    say: Callable[[str], None] = lambda line: None, floor: float | None = None) -> Result:
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
    ``k``."""
    objective, budget = search.options.objective, search.memory_bytes
    least: dict[frozenset[str], float] = {}
    recent: dict[frozenset[str], PlanGraph] = {}  # the last tables built, for the solve that follows a probe
    work = SharedWork()  # the layers two choices treat alike are built once

    def table(units: frozenset[str]) -> PlanGraph:
        if units in recent:
            recent[units] = recent.pop(units)  # the most recently used last: the least recently used goes first
        else:
            if len(recent) >= RECENT_TABLES:
                recent.pop(next(iter(recent)))
            recent[units] = search.table(cap, mesh, units, work)
            least[units] = least_memory(recent[units])
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
        free = _solve_free(plain, search, cut_of(incumbent, objective))
        if free.memory <= budget:
            return free  # the fastest plan of every choice, and it fits
        floor = free.solution.bound
    if budget is not None and (c := cut_of(incumbent, objective)) is not None and chains[0][-1]:
        if (p := budget_bound(plain, table(chains[0][-1]), objective, budget, c)) is not None:
            raise p  # no recomputation choice fits a plan of this mesh that beats the cut
    misfits: list[MemoryBudgetError] = []
    starts: list[list[frozenset[str]]] = []
    for chain in chains:
        if not fits(chain[-1]):
            misfits.append(MemoryBudgetError(least[chain[-1]], mesh))
            continue
        lo, hi = 0, len(chain) - 1
        while lo < hi:  # the first choice that can fit
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(chain[mid]) else (mid + 1, hi)
        if lo > 0:
            misfits.append(MemoryBudgetError(least[chain[lo - 1]], mesh))
        starts.append(chain[lo:])
    return chain_search(cap, mesh, search, starts, table, incumbent, say, floor, misfits)


def chain_search(cap: Captured, mesh: Mesh, search: Search, chains: Sequence[Sequence[frozenset[str]]],
                 table: Callable[[frozenset[str]], PlanGraph], incumbent: Incumbent = None,
                 say: Callable[[str], None] = lambda line: None, floor: float | None = None,
                 misfits: Sequence[MemoryBudgetError] = ()) -> Result:
    """The best plan over the recomputation choices of ``chains`` (each a run of choices that can all fit, in
    chain order), by best-first branch and bound on stretches of a chain.

    The first chain's first and last choices are solved first (plans to prune by), each also priced with fewer
    layers recomputed (``shift``).  Then a stretch ``[a, b]`` of a chain is bounded at once by
    ``search.chain.stretch_bound`` (from the duals of its two ends under the budget; ``floor``, the plain table's
    bound, bounds every choice), a single choice by its own dual, and the region with the lowest bound is taken
    next: first its bound is tightened (``search.chain.tighten``: more multipliers) towards what would prune it; if
    it still cannot be pruned, a single choice is solved exactly (``solve_table_on``) and a stretch is split at its
    middle choice, whose dual is checked to lie on the line of its ends' (``search.chain.affine``: a chain that
    fails loses its stretch bounds, and every stretch of it is searched again choice by choice).  The search ends
    when the lowest bound left is within ``gap`` of the best plan (or reaches the incumbent: another mesh's plan is
    better), or ``time_limit_s`` after it began (each solve gets what is left, at least a second); the result's
    bound is the least of its own and every region left or pruned.  ``Pruned`` when every region reaches the
    incumbent."""
    import heapq

    from .search.chain import MULTIPLIERS, Dual, affine, dual, stretch_bound, tighten

    objective, budget, gap = search.options.objective, search.memory_bytes, search.options.gap
    layer_set = set(recomputable_layers(cap))
    ties = search.options.tie_layers and search.options.solver != "brute"
    duals: dict[tuple[int, int], Dual] = {}
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

    def dual_of(c: int, i: int) -> Dual | None:
        if objective != "time":
            return None
        if (c, i) not in duals:
            units = chains[c][i]
            g = table(units)
            lams = np.array(MULTIPLIERS) * scale / budget if budget is not None else np.zeros(1)
            duals[(c, i)] = dual(g, layers_in(units, layer_set), find_repeats(g) if ties else [], lams, budget or 0.0)
        return duals[(c, i)]

    def ends(c: int, a: int, b: int) -> list[Dual]:
        """The duals that bound region ``[a, b]`` of chain ``c`` (none: only ``floor`` does)."""
        if a < b and c in broken:
            return []
        ds = [dual_of(c, a)] if a == b else [dual_of(c, a), dual_of(c, b)]
        return [d for d in ds if d is not None]

    def region_bound(c: int, a: int, b: int, target: float | None = None) -> float:
        base = floor if floor is not None else -math.inf
        ds = ends(c, a, b)
        if not ds:
            return base
        got = ds[0].bound if len(ds) == 1 else stretch_bound(ds[0], ds[1])
        if target is not None and got < target:
            got = tighten(ds, target)
        return max(base, got)

    heap: list[tuple[float, int, int, int]] = []

    def push(c: int, a: int, b: int) -> None:
        heapq.heappush(heap, (region_bound(c, a, b), c, a, b))

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
            r = solve_table_on(table(units), within, limit, units)
        except MemoryBudgetError as e:
            failed.append(e)
            return
        except Pruned as e:
            lowest = min(lowest, max(bound, e.bound))
            pruned = pruned or e
            return
        except SearchError:  # no plan found in time: this choice's bound stands
            lowest = min(lowest, bound)
            return
        lowest = min(lowest, max(bound, r.solution.bound))
        say(f"mesh {mesh}: recompute {len(units)} units: {r.value(objective):.4g} ({objective})")
        if best is None or r.value(objective) < best.value(objective):
            best = r
        if budget is not None and objective == "time":
            shift(c, i, r)

    def shift(c: int, i: int, r: Result) -> None:
        """A plan for free: ``r``'s tilings with fewer layers recomputed, as many fewer as the memory it leaves
        under the budget pays for (each layer kept saves its rerun).  Every choice's table has the same variables
        and strategies (recomputation changes costs, not domains), so ``r``'s choice is a plan of each; its memory
        per layer is read off a second choice (a line: each layer kept adds its activations), and the plan is
        priced exactly on the choice it lands on, and kept when it fits and beats the best."""
        nonlocal best
        assert budget is not None
        k_of = {layers_in(u, layer_set): j for j, u in enumerate(chains[c])}
        k_here = layers_in(chains[c][i], layer_set)
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
        k_probe = layers_in(chains[c][0], layer_set)
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
    # Plans to prune by: the first chain's first choice (the least recomputed that can fit) and last (all of its
    # layers, the least memory: the most room for a fast tiling), each shifted to the budget (``shift``).
    for i in sorted({0, len(chains[0]) - 1} if chains else ()):
        solve_choice(0, i, floor if floor is not None else -math.inf)
    scale = best.step_time_s if best is not None else floor if floor is not None and math.isfinite(floor) else 0.0
    if scale <= 0.0:  # else the plain table's bound
        p = to_problem(table(frozenset()), "time")
        scale = max(lower_bound(reduce(p, argmins=False), p), 1e-30)
    for c, chain in enumerate(chains):
        if c == 0 and len(chain) > 2:
            push(c, 1, len(chain) - 2)
        elif c > 0:
            push(c, 0, len(chain) - 1)
    while heap:
        bound, c, a, b = heapq.heappop(heap)
        other = cut_of(incumbent, objective)
        mine = best.value(objective) if best is not None else None
        # what prunes this region: the incumbent, or a bound within ``gap`` of this mesh's best plan
        target = min(x for x in (other, mine * (1 - gap) if mine is not None else None, math.inf) if x is not None)
        if target < math.inf:
            bound = region_bound(c, a, b, target)
        if other is not None and bound >= other:
            pruned, lowest = Pruned(bound, other), min(lowest, bound)
            continue
        if mine is not None and (bound >= mine or relative_gap(mine, bound) <= gap):
            lowest = min(lowest, bound)
            if a < b and c not in broken:
                given_up.append((c, a, b))
            continue
        if time.perf_counter() > deadline:
            lowest = min(lowest, bound, *(h[0] for h in heap))
            say(f"mesh {mesh}: recomputation search stopped at its time limit, bound {lowest:.4g}")
            stopped = True
            break
        if a == b:
            if (c, a) not in solved:  # the middle of two stretches is reached from both
                solve_choice(c, a, bound)
            continue
        if c in broken or b - a == 1:
            for i in range(a, b + 1):
                push(c, i, i)
            continue
        m = (a + b) // 2
        da, dm, db = dual_of(c, a), dual_of(c, m), dual_of(c, b)
        if da is not None and dm is not None and db is not None and da.shape == db.shape and not affine(da, dm, db):
            broken.add(c)  # this chain's stretch bounds were not exact: search it choice by choice
            say(f"mesh {mesh}: recomputation chain {c} is not affine in its layers: searched choice by choice")
            for cc, aa, bb in [r for r in given_up if r[0] == c] + [(c, a, b)]:
                for i in range(aa, bb + 1):
                    push(cc, i, i)
            given_up = [r for r in given_up if r[0] != c]
            continue
        push(c, a, m)
        push(c, m, b)
    if best is None:
        if pruned is not None and not stopped and lowest >= pruned.cutoff:  # every region reached the incumbent
            raise Pruned(lowest if lowest < math.inf else pruned.bound, pruned.cutoff)
        if failed:
            raise min(failed, key=lambda e: e.least)
        raise SearchError(f"no plan found on mesh {mesh} with any recomputation in the time limit")
    if objective == "time" and (lowest < best.solution.bound or best.solution.solver == "shifted"):
        t = best.step_time_s
        status = best.solution.status if relative_gap(t, lowest) <= gap else "feasible"
        best.solution = replace(best.solution, bound=min(lowest, t), status=status)
    return best


# Tables of one mesh's recomputation choices kept for reuse (the bisection's probes, the solves, the duals and
# ``shift`` return to a few choices; one Llama-3-70B table on a 3-axis mesh took 3 s to build again).
RECENT_TABLES = 4
# Choices ``chain_search``'s ``shift`` prices at most per plan, from the fewest layers recomputed the line allows.
SHIFT_TRIES = 3


def cut_of(incumbent: Incumbent, objective: str) -> float | None:
    """The incumbent's value now, when it bounds ``objective`` (step time only)."""
    return now(incumbent) if objective == "time" else None


# Multipliers (as multiples of cut / budget: seconds per byte) at which ``budget_bound`` tries the Lagrangian bound.
BOUND_MULTIPLIERS = (0.5, 2.0, 8.0)


def budget_bound(plain: PlanGraph, least: PlanGraph, objective: str, budget: float, cut: float) -> Pruned | None:
    """``Pruned`` when no recomputation choice on this mesh has a plan within ``budget`` that beats ``cut``.

    Every choice ``A`` and tiling ``x`` cost at least what nothing recomputed costs (``plain``: recomputation only
    adds time) and keep at least what every layer recomputed keeps (``least``, the last choice of the chains:
    memory shrinks as the recomputed set grows).  So for any ``lam >= 0``, by weak duality,

        min_{x, A: M(x, A) <= B} T(x, A)  >=  min_x T_plain(x) + lam * (M_least(x) - B),

    an unbudgeted problem over the plain table's costs with ``lam`` times the other table's memory added, whose
    ``search.lower_bound`` is a bound of every choice at once: one cheap bound per multiplier
    (``BOUND_MULTIPLIERS``) instead of a search over the choices.  None when no multiplier reaches the cut (or
    the two tables do not line up)."""
    for f in BOUND_MULTIPLIERS:
        bound = recompute_bound(plain, least, objective, budget, f * cut / budget)
        if bound is None:
            return None
        if bound >= cut:
            return Pruned(bound, cut)
    return None


def recompute_bound(plain: PlanGraph, least: PlanGraph, objective: str, budget: float, lam: float) -> float | None:
    """``budget_bound``'s lower bound at multiplier ``lam`` (None when the two tables do not line up)."""
    p = to_problem(plain, objective)
    q = to_problem(least, objective, budget)
    assert q.memory is not None and q.budget is not None
    if [u.shape for u in p.unary] != [m.shape for m in q.memory]:
        return None
    r = Problem([u + lam * m for u, m in zip(p.unary, q.memory)], p.edges, None, None, p.names)
    return lower_bound(reduce(r, argmins=False), r) - lam * q.budget


def least_memory(g: PlanGraph) -> float:
    """The smallest per-device memory any plan of ``g`` reaches: memory is a sum of one term per
    variable (less the constant ``rerun_credit``) in each phase (``graph.phase_memory``), so each variable's
    cheapest strategy together is the exact minimum of each phase, and the larger of the two a lower bound of the
    step's (exact when one strategy per variable is cheapest in both)."""
    act = float(sum(phase_memory(v, "activations").min() for v in g.vars)) - g.rerun_credit
    return max(act, float(sum(phase_memory(v, "gradients").min() for v in g.vars)))


class MemoryBudgetError(SearchError):
    """No plan fits the per-device memory budget; ``least`` is the smallest budget (bytes, as ``memory_gb``
    gives it) any plan on ``mesh`` fits: its least modelled peak ``modelled`` plus the headroom.  ``hints``: other
    options under which some plan fits the budget (``budget_hints``)."""

    def __init__(self, modelled: float, mesh: Mesh, hints: Sequence[str] = ()) -> None:
        self.modelled, self.mesh, self.hints = modelled, mesh, tuple(hints)
        self.least = least = budget_needed(modelled)
        gb = least / GIB
        step = 10 ** (math.floor(math.log10(gb)) - 3) if gb > 0 else 1.0
        enough = math.ceil(gb / step) * step  # 4 significant digits, rounded up: a budget that fits
        fits = "".join(f"; it fits with {h}" for h in self.hints)
        super().__init__(f"no plan fits the memory budget on mesh {mesh}: the smallest any plan reaches is "
                         f"{gb:.4g} GiB per device; give --memory-gb {enough:.4g} (GiB) or more{fits}")

    def __reduce__(self) -> tuple:  # rebuilt from its fields, not its message (a planner worker sends it)
        return (MemoryBudgetError, (self.modelled, self.mesh, self.hints))

    def with_hints(self, hints: Sequence[str]) -> MemoryBudgetError:
        """This error naming the options ``hints`` under which a plan fits."""
        return MemoryBudgetError(self.modelled, self.mesh, hints) if hints else self


def budget_hints(cap: Captured, model: torch.nn.Module | None, example_inputs: Any, example_kwargs: Any,
                 search: Search, meshes: Sequence[Mesh], recompute: str) -> list[str]:
    """The options under which some plan on ``meshes`` fits ``search.memory_bytes`` where the given ones fit
    none: ``--recompute auto`` (when recomputation was not already free to choose; every layer recomputed is
    the least memory it reaches), ``--precision bf16-mixed`` (an fp32 model captured again under it, with
    recomputation as given or free), each checked by the least modelled memory of the tables (``least_memory``),
    never guessed.  Run only on the way to the error."""
    budget = search.memory_bytes
    if budget is None:
        return []

    def fits(c: Captured, units: frozenset[str]) -> bool:
        return any(least_memory(search.table(c, m, units)) <= budget for m in meshes)

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


# The share of the ops' training compute taken as backward, the work an asynchronous gradient
# all-reduce can hide behind: 2 of a linear layer's 3 forward-equivalents (graph.passes).  A flat
# share, not each op's own (passes - 1) / passes: an approximation of the cap.
BACKWARD_SHARE = 2.0 / 3.0


def evaluate(g: PlanGraph, sol: Solution) -> Result:
    """The modelled cost of ``sol``: bytes, communication (reshards; inside ops: halos, summed statistics),
    compute, memory, and the gradient-sync time hidden behind backward,
    ``min(grad_overlap * sync, BACKWARD_SHARE * op compute)``."""
    b = s = sync = 0.0
    for e in g.edges:
        i, j = sol.choice[e.src], sol.choice[e.dst]
        b += e.bytes[i, j]
        s += e.seconds[i, j]
        sync += e.sync[i, j] if e.sync is not None else 0.0
    comp = op_comp = 0.0
    for v, c in zip(g.vars, sol.choice):
        in_b, in_s = (float(v.op_comm[c, 0]), float(v.op_comm[c, 1])) if v.op_comm is not None else (0.0, 0.0)
        b += in_b  # communication inside an op (halo exchange, summed statistics), priced with its strategy
        s += in_s
        comp += float(v.compute_s[c]) - in_s
        op_comp += float(v.compute_s[c]) - in_s if v.kind == "op" else 0.0
    hidden = min(g.profile.grad_overlap * sync, BACKWARD_SHARE * op_comp)
    return Result(g, sol, b, s, comp, max(phase_peaks(g, sol.choice)), hidden, sync, cap_s=BACKWARD_SHARE * op_comp)


def plan(
    model: torch.nn.Module | None,
    example_inputs: tuple | dict | torch.Tensor = (),
    devices: int | None = None,
    *,
    options: PlanOptions | None = None,
    baselines: bool = True,
    captured: Captured | None = None,
    progress: Callable[[str], None] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    cache_routes: bool = False,
    **option_fields: Any,
) -> Plan:
    """The best plan for ``model`` on ``devices`` (or on ``mesh``).

    How to plan is ``options`` (``soybean.options.PlanOptions``), with any of its fields given as keywords
    on top (``mesh=``, ``objective=``, ``profile=``, ``memory_gb=``, ...; ``None`` leaves a field as it is):

    ``example_inputs`` are forward's positional arguments and ``example_kwargs`` its keyword arguments (a dict
    given as ``example_inputs`` is taken as the keywords): ``model(*example_inputs, **example_kwargs)``.

    ``local_batch``: the cheaper contract -- every input split on dim 0 over the whole mesh (each
    rank passes its slice) and non-scalar outputs left in their planned tiling.
    ``time_limit_s``: each ILP solve stops after this long with the best plan found, its bound and
    gap recorded in ``solver``.  A mesh on which no plan fits the memory budget is skipped; when none
    fits, ``MemoryBudgetError`` names the smallest budget any mesh reaches.
    ``gpus_per_node``: devices per node (ranks fill nodes in order); every mesh shape is priced with the
    axes whose groups cross nodes on the profile's inter-node link, so the search also picks which axes
    stay inside a node.
    ``tie_layers``: repeated isomorphic layers share one set of decision variables (``search.tying``:
    exact pricing, the optimum over tied plans; ``plan.tying`` says which layers).
    ``gap``: each solve stops once its plan is proven within this relative gap of optimal.
    ``recompute``: ``auto`` (default): which layers to recompute is decided with the tilings
    (``solve_recompute``), the fastest plan within ``memory_gb`` (none without a budget); ``none``; ``layers``:
    every layer (a block of a repeated stack without in-place updates or halo windows,
    ``graph.recomputable_layers``) reruns its forward in backward instead of keeping its activations
    (``codegen.recompute``), priced as such; ``attention``: only each layer's attention module
    (``graph.attention_units``: selective recomputation).  ``plan.recompute`` lists the recomputed units.
    When no mesh fits ``memory_gb``, the ``MemoryBudgetError`` names the options that would fit
    (``budget_hints``).
    ``precision``: ``fp32`` (default) or ``bf16-mixed`` (``soybean.precision``); with ``captured=``, the
    capture's own.
    ``collectives``: ``auto`` (default): each collective runs the algorithm modelled cheapest for its group
    and message (``cost.collectives.choose``: the backend's, or soybean's ``lp``, ``ring``, ``tree``); or one of
    ``ir.algorithms.ALGORITHMS`` forced wherever it applies.  ``plan.reshards`` lists each choice.
    ``progress``: called with a short line at each stage (capture, each mesh shape with its optimum and
    gap, the baselines).
    ``cache_routes``: start from the route walks earlier runs stored on disk, and store this run's
    (``route_cache``; the command line's default, off with ``--no-cache``).
    """
    with gc_paused():  # one cyclic collection at the end, not one per table built (seconds each at scale)
        return _plan(model, example_inputs, devices, options, baselines, captured, progress, example_kwargs,
                     option_fields, cache_routes)


def _plan(model: torch.nn.Module | None, example_inputs: tuple | dict | torch.Tensor, devices: int | None,
          options: PlanOptions | None, baselines: bool, captured: Captured | None,
          progress: Callable[[str], None] | None, example_kwargs: dict[str, Any] | None,
          option_fields: dict[str, Any], cache_routes: bool = False) -> Plan:
    say = progress or (lambda line: None)
    opts = merge_options(options, devices=devices, **option_fields)  # every option checked there
    if plan_kind(opts) != "plain":  # a front end's choice (``options.plan_kind``): planned here, it would be dropped
        raise ValueError(f"soybean.plan makes one program over every device, not pipeline={opts.pipeline!r} or "
                         f"placement={opts.placement!r}: soybean.parallelize and `soybean plan` plan those")
    mesh = Mesh(opts.mesh) if opts.mesh else None
    devices, objective, precision, recompute = opts.world, opts.objective, opts.precision, opts.recompute
    profile = opts.profile if isinstance(opts.profile, Profile) else load_profile(opts.profile)
    search = Search(with_collectives(replace(profile, expert_imbalance=opts.expert_imbalance), opts.collectives), opts,
                    budget_bytes(opts.memory_gb))
    prof, budget = search.profile, search.memory_bytes
    loaded = route_cache.load(search.pricing) if cache_routes else None

    def keep_routes() -> None:  # this process's walks stored for the next run (``route_cache``)
        if loaded is not None:
            route_cache.save(search.pricing, loaded)

    if captured is not None:
        cap = captured
        if precision is not None and policy(precision).name != cap.precision:
            raise ValueError(f"precision {precision!r} but captured= was captured under {cap.precision!r}: "
                             f"capture with precision={precision!r}")
    elif model is not None:
        say("capture")
        args, kwargs = split_example(example_inputs, example_kwargs)
        cap = capture(model, args, kwargs, precision=policy(precision).name)
    else:
        raise CaptureError("could not capture: plan() was given neither a model nor captured=")
    if recompute == "auto" and budget is None:
        recompute = "none"  # recomputation only adds time: without a budget there is nothing to buy with it
    rec = recompute_units(cap, recompute) if recompute != "auto" else frozenset()
    t0 = time.perf_counter()
    meshes = [mesh] if mesh else factorizations(devices)
    results: list[Result] = []
    misfits: list[MemoryBudgetError] = []
    failed: list[SearchError] = []
    pruned: list[dict[str, Any]] = []
    floors: dict[Mesh, float] = {}  # a mesh's plain plan's bound, where that plan does not fit the budget
    estimate: dict[Mesh, float] = {}  # what each mesh searched reached: its plan's value (inf: no plan)

    def rank(r: Result) -> tuple[float, int]:  # the best mesh: cheapest, then fewest axes
        return r.value(objective), r.graph.mesh.ndim

    jobs = opts.jobs if opts.jobs is not None else default_jobs(len(cap.graph.nodes), len(meshes))

    def record(m: Mesh, outcome: Result | BaseException) -> None:
        """A mesh's plan kept in ``results``, or why there is none recorded."""
        # from above, for ``by_promise``: a plan's value, also one that does not fit the budget; no plan, none (a
        # pruned mesh's bound is from below: on 64 devices it put two children of a pruned 2x32 first, 10 s each)
        estimate[m] = (outcome.value if isinstance(outcome, _Floor) else
                       outcome.value(objective) if isinstance(outcome, Result) else math.inf)
        if isinstance(outcome, _Floor):
            floors[m] = outcome.bound
            say(f"mesh {m}: its fastest plan needs recomputation or more memory: bound {outcome.bound:.4g}")
        elif isinstance(outcome, MemoryBudgetError):
            misfits.append(outcome)
            say(f"mesh {m}: no plan fits the memory budget")
        elif isinstance(outcome, Pruned):  # proven no better than a mesh already solved
            pruned.append({"mesh": list(m.shape), "bound": outcome.bound, "pruned": True})
            say(f"mesh {m}: lower bound {outcome.bound:.4g} is no better than the best so far: not solved")
        elif isinstance(outcome, SearchError):  # this mesh found no plan in its time: the others still count
            failed.append(outcome)
            say(f"mesh {m}: no plan found ({outcome})")
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            outcome.graph.pricing = search.pricing  # a worker's table comes without it
            _peaked(search, outcome)  # where the next stage's workers start their cap searches
            results.append(outcome)
            sol = outcome.solution
            lead = min(results, key=rank)
            for r in results:  # only the best mesh's tables are read again: free the others' (GBs at 64 devices)
                if r is not lead and r.graph.vars:
                    r.graph = PlanGraph(r.graph.mesh, r.graph.profile, pricing=search.pricing)
            say(f"mesh {m}: {outcome.value(objective):.4g} ({objective}), "
                f"gap {relative_gap(sol.objective, sol.bound):.2%}")

    base: dict[str, dict[str, Any]] = {}
    priced: list[bool] = []

    def price_base(tell: Callable[[str], None]) -> dict[str, dict[str, Any]]:
        """The baselines (``soybean.baselines``): on a worker once it is out of meshes, else after the search."""
        tell("baselines")
        return price_baselines(cap, devices, prof, objective,
                               lambda g: solve_table(g, objective, "ilp", opts.time_limit_s, opts.tie_layers), budget,
                               opts.gpus_per_node, search.pricing)

    def got_base(records: dict[str, dict[str, Any]]) -> None:
        base.update(records)
        priced.append(True)

    def each(ms: Sequence[Mesh], solve_mesh: Callable[[Mesh, Incumbent, Callable[[str], None]], Result],
             staged: bool = False) -> None:
        """``solve_mesh`` on every mesh of ``ms`` (on ``jobs`` processes, ``mesh_pool``), each outcome recorded.
        ``staged``, with many meshes of three axes (more than ``mesh_pool.FEW_PER_WORKER`` per worker): the meshes
        of at most two axes first, with the baselines beside them (``price_base``), then the others in the order of
        ``by_promise``, on what the first stage found."""
        low, high = [m for m in ms if m.ndim < 3], [m for m in ms if m.ndim >= 3]
        stages = [low, high] if staged and low and len(high) > FEW_PER_WORKER * jobs else [list(ms)]
        for stage in stages:
            incumbent = min((r.step_time_s for r in results), default=None) if objective == "time" else None
            for m, outcome in each_mesh(by_promise(stage, estimate) if staged else stage, solve_mesh, _light,
                                        lambda r: r.step_time_s if objective == "time" else None, jobs, say,
                                        (SearchError, _Floor), incumbent,
                                        (price_base, got_base) if baselines and not priced else None,
                                        keep_routes if loaded is not None else None):
                record(m, outcome)

    # Under a budget with recomputation free, every mesh's fastest plan with nothing recomputed and no budget
    # (``solve_plain``) comes first: one table each; those that fit are their mesh's answer and set the
    # incumbent, and the rest are searched cheapest bound first, each pruned at once when its bound reaches the
    # incumbent (a mesh whose budget binds hard is slow to search and rarely wins).
    def plain(m: Mesh, incumbent: Incumbent, tell: Callable[[str], None]) -> Result:
        tell(f"mesh {m}: nothing recomputed, no budget")
        try:
            free = solve_plain(cap, m, search, incumbent)
        except Pruned:
            raise
        except SearchError:  # no plain plan in the time limit: the recomputation search still tries the mesh
            raise _Floor(-math.inf) from None
        if budget is not None and free.memory > budget:
            raise _Floor(free.solution.bound, free.value(objective))
        return free

    if recompute == "auto" and budget is not None and objective == "time":
        each(meshes, plain, staged=True)
        meshes = sorted(floors, key=floors.__getitem__)

    def searched(m: Mesh, incumbent: Incumbent, tell: Callable[[str], None]) -> Result:
        tell(f"mesh {m}: build and solve")
        if recompute != "auto":
            return solve_on(cap, m, search, incumbent, rec)
        if m in floors and (cut := now(incumbent)) is not None and floors[m] >= cut:
            raise Pruned(floors[m], cut)
        return solve_recompute(cap, m, search, incumbent, tell, floors.get(m))

    each(meshes, searched, staged=not floors)
    if not results:
        if misfits and not failed:
            least = min(misfits, key=lambda e: e.least)
            raise least.with_hints(budget_hints(cap, model, example_inputs, example_kwargs, search,
                                                [e.mesh for e in misfits], recompute))
        raise failed[0]
    best = min(results, key=rank)
    # A worker sends a plan without its table only when another plan, sent whole, was at least as good (``_light``).
    assert best.graph.vars, f"mesh {best.graph.mesh}: the best plan came from a worker without its table"
    seconds = time.perf_counter() - t0
    if baselines and not priced:
        got_base(price_base(say))
    if best.graph.fallback_ops:
        warnings.warn(
            f"soybean: no sharding rule for {', '.join(best.graph.fallback_ops)}; these ops run replicated",
            stacklevel=2,
        )
    if best.graph.data_dependent:
        warnings.warn(data_dependent_warning(best.graph.data_dependent), stacklevel=2)
    out = to_plan(cap, best, objective, prof.name, devices, base, seconds, opts.solver, results, best.recompute)
    out.collectives = opts.collectives
    out.meshes += pruned
    out.local_batch = opts.local_batch
    out.gpus_per_node = opts.gpus_per_node
    keep_routes()
    return out


def by_promise(meshes: Sequence[Mesh], estimate: dict[Mesh, float]) -> list[Mesh]:
    """``meshes`` most promising first, by what their *parents* reached: the meshes of one axis fewer made by
    merging two neighbouring axes (``(a, b, c)``: ``(a b, c)`` and ``(a, b c)``).  A tiling of a parent is one of
    the mesh's own (``S(d)`` on the merged axis is ``S(d)`` on both, the outer one cutting first), so a parent's
    plan is an estimate from above of the mesh's best; ordered by the better parent's ``estimate``, then the worse
    one's, then as given.  An order only: every mesh is still searched or pruned by a bound, so the plan is the
    same, but the best found early prunes the rest cheaply (Llama-3-8B on 1,024: 16x8x8 before 2x64x8)."""
    def parents(m: Mesh) -> list[float]:
        s = m.shape
        merged = [Mesh(s[:i] + (s[i] * s[i + 1],) + s[i + 2:]) for i in range(len(s) - 1)]
        return sorted(estimate.get(p, math.inf) for p in merged) or [math.inf]

    order = {m: k for k, m in enumerate(meshes)}
    return sorted(meshes, key=lambda m: (parents(m), order[m]))


def _light(r: Result) -> Result:
    """``r`` without its table, as a worker sends a plan that does not lead when found (``mesh_pool``): the plan's
    choice and figures, for the record of meshes."""
    return replace(r, graph=PlanGraph(r.graph.mesh, r.graph.profile))


class _Floor(Exception):
    """``_plan``'s first pass: this mesh's fastest plan does not fit; ``bound`` bounds every plan of it, ``value``
    is the plan's step (inf: none found), an estimate from above of the mesh's plans without a budget."""

    def __init__(self, bound: float, value: float = math.inf) -> None:
        super().__init__(bound, value)  # both, so a worker's pickled copy is rebuilt whole
        self.bound, self.value = bound, value


def solve_table(g: PlanGraph, objective: str, solver: str = "ilp", time_limit_s: float = 60.0,
                tie_layers: bool = True) -> Result:
    """Solve a table already built (a baseline's restricted one) as ``solve_on`` solves its own, with no memory
    budget, its repeated layers tied unless ``tie_layers`` is off (``search.tying``): every layer of a stack laid
    out alike, as experts run them and as the plan's own search ties them (Llama-3-8B's baselines on 64 devices:
    the same step times, each proven optimal, in 1.0 s of solves against 5.3 s untied)."""
    return solve_table_on(g, Search(g.profile, PlanOptions(objective=objective, solver=solver,
                                                           time_limit_s=time_limit_s, tie_layers=tie_layers)))


def to_plan(
    cap: Captured,
    r: Result,
    objective: str,
    profile: str,
    devices: int,
    baselines: dict,
    seconds: float,
    solver: str,
    all_results: list[Result],
    recompute: frozenset[str] = frozenset(),
) -> Plan:
    g, sol = r.graph, r.solution
    params: dict[str, list[str]] = {}
    inputs: dict[str, list[str]] = {}
    nodes: dict[str, dict[str, Any]] = {}
    for v, c in zip(g.vars, sol.choice):
        st = v.strategies[c]
        if v.kind in ("param", "buffer"):
            params[v.fqn] = [str(p) for p in st.outputs[0]]
        elif v.kind == "input":
            inputs[v.name] = [str(p) for p in st.outputs[0]]
        elif v.kind == "op":
            nodes[v.name] = {"in": [[str(p) for p in t] for t in st.inputs],
                             "out": [[str(p) for p in t] for t in st.outputs]}
            if st.variant:
                nodes[v.name]["variant"] = st.variant
        elif v.kind == "reshard":
            nodes[v.name] = {"in": [[str(p) for p in t] for t in st.inputs],
                             "out": [[str(p) for p in t] for t in st.outputs],
                             "grad_partial": [list(v.grad_partial[c])]}
    for alias, fqn in cap.aliases.items():
        if fqn in params:
            params[alias] = params[fqn]
    return Plan(
        devices=devices, mesh=list(g.mesh.shape), objective=objective, profile=profile, fingerprint=cap.fingerprint,
        params=params, inputs=inputs, nodes=nodes,
        cost={"comm_bytes": float(r.comm_bytes), "step_time_s": float(r.step_time_s), "comm_s": float(r.comm_s),
              "compute_s": float(r.compute_s), "hidden_s": float(r.hidden_s), "sync_s": float(r.sync_s),
              "memory_bytes": float(r.memory)},
        baselines=baselines,
        solver={"name": sol.solver if solver != "brute" else "brute", "status": sol.status, "seconds": seconds,
                "objective": sol.objective, "bound": sol.bound,
                "gap": 0.0 if sol.status == "optimal" else relative_gap(sol.objective, sol.bound)},
        meshes=[{"mesh": list(x.graph.mesh.shape), "objective": x.value(objective)} for x in all_results],
        fallback_ops=g.fallback_ops, layers=layer_rows(g, sol), memory=memory_breakdown(g, sol),
        precision=cap.precision, recompute=sorted(recompute), reshards=reshard_records(g, sol.choice),
        tying={"used": bool(r.runs), "runs": [x.record() for x in r.runs],
               "variables": [len(g.vars), len(g.vars) - sum(len(b) for x in r.runs for b in x.blocks[1:])]},
        keys=[[n, k] for n, k in cap.keys.items() if n in nodes], moe=moe_records(g, sol),
        context_parallel=context_parallel_records(g, sol),
    )


def with_collectives(profile: Profile, collectives: str) -> Profile:
    """``profile`` restricted to the collective algorithms ``collectives`` allows: ``auto`` every one (or the
    profile's own list), else the one named (``ir.algorithms.ALGORITHMS``)."""
    if collectives == "auto":
        return profile
    return replace(profile, algorithms=(check_algorithm(collectives),))


