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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .baselines import batch_split, model_parallel_domains, price as price_baselines
from .capture import Captured, CaptureError, capture, split_example
from .cost.memory import GIB, budget_bytes, budget_needed
from .cost.pricing import PricingCache
from .cost.profiles import Profile, load_profile
from .graph import (
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
from .options import PlanOptions, options as merge_options
from .plan import Plan
from .precision import policy
from .records import layer_rows, memory_breakdown, reshard_records
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
        return build(cap, mesh, self.on_mesh(mesh), objective=o.objective,
                     domains=_domains(cap, mesh, o.mode, o.local_batch), pin_params=o.mode in ("dp", "mp"),
                     local_outputs=o.local_batch, divide_work=True if o.mode in ("dp", "mp") else None,
                     recompute=recompute, pricing=self.pricing, work=work)


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

    def solved(mu: float = 0.0, phase: str = "activations", cutoff: float | None = None) -> Result:
        ov = (1.0 - mu) * g.profile.grad_overlap
        problem = to_problem(g, objective, memory_bytes, overlap=ov, phase=phase, compute_credit=mu * BACKWARD_SHARE)
        r = evaluate(g, solve(problem, solver, search.options.time_limit_s, search.options.gap, runs, cutoff=cutoff))
        r.runs, r.recompute = runs, recompute
        return r

    # The budget binds the activations phase; a plan whose gradients phase breaks it is replaced by the best plan
    # with both phases summed (an upper bound of the larger).
    phase = "activations"
    r = solved(cutoff=now(incumbent))
    if memory_bytes is not None and r.memory > memory_bytes:
        phase = "sum"
        r = solved(phase=phase, cutoff=now(incumbent))
    if objective != "time" or (settle is not None and settle(r)):
        return r
    return capped_overlap(r, lambda mu, cut: solved(mu, phase, cut), search.options.gap, incumbent)


# The most Lagrangian members ``capped_overlap`` solves after the first.
OVERLAP_STEPS = 6
# Members closer than this are met again: their problems differ by ``MU_MET * (o S - b K)`` per plan, below the
# gaps searched (Llama-3-8B on 8x4x2: the crossing landed 1.5e-6 from the member before it, and solved it again).
MU_MET = 1e-4


def capped_overlap(first: Result, solved: Callable[[float, float | None], Result], gap: float,
                   incumbent: Incumbent = None) -> Result:
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
    bound reaches ``incumbent`` (another mesh is better; read before each member).  The result's ``solution``
    carries ``T`` of its plan as objective and the best bound."""
    o = first.graph.profile.grad_overlap

    def line(r: Result) -> tuple[float, float]:  # T_mu of r's plan = a + mu * slope
        a = r.comm_s + r.compute_s - o * r.sync_s
        return a, o * r.sync_s - r.cap_s

    best, bound = first, first.solution.bound
    lo, hi = line(first), None
    if lo[1] > 0:
        seen = {tuple(first.solution.choice)}
        mu, tried = 1.0, {0.0}
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
                r = solved(mu, cut)
            except Pruned as e:  # this member's bound already reaches the incumbent: so does T's
                raise Pruned(max(bound, e.bound), cut if cut is not None else e.bound) from None
            bound = max(bound, r.solution.bound)
            best = min(best, r, key=lambda x: x.step_time_s)
            key = tuple(r.solution.choice)
            if key in seen:
                break  # the envelope of the plans found is the dual at its peak
            seen.add(key)
            a, slope = line(r)
            if slope > 0:
                lo = (a, slope)
            else:
                hi = (a, slope)
            if hi is None:
                break  # the dual rises all the way to member 1: its bound is the dual's best
            mu = min(1.0, max(0.0, (hi[0] - lo[0]) / (lo[1] - hi[1])))  # where the two lines cross
    t, bound = best.step_time_s, min(bound, best.step_time_s)
    status = best.solution.status if relative_gap(t, bound) <= gap else "feasible"
    best.solution = replace(best.solution, objective=t, bound=bound, status=status)
    return best


def recompute_units(cap: Captured, recompute: str) -> frozenset[str]:
    """The units a fixed ``recompute`` choice reruns (``none``, ``layers``, ``attention``)."""
    return frozenset({"none": (), "layers": recomputable_layers(cap), "attention": attention_units(cap)}[recompute])


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
    solved it) bounds them all.  Along a chain each step recomputes more ops, so the least
    memory any plan reaches only shrinks: the first choice that can fit the budget is found by bisection on it (the
    choices before it cannot fit), and from there the chain is solved in order until the lower bound of a choice's
    unbudgeted problem reaches the best plan found (no later choice of the chain can beat it).  Exact over the
    choices searched; for a stack of equal layers, which ``k`` layers are recomputed does not change the model,
    so ``A_k`` stands for any ``k``."""
    objective, budget = search.options.objective, search.memory_bytes
    best: Result | None = None
    misfits: list[MemoryBudgetError] = []
    pruned: Pruned | None = None
    least: dict[frozenset[str], float] = {}
    recent: dict[frozenset[str], PlanGraph] = {}  # the last tables built, for the solve that follows a probe
    work = SharedWork()  # the layers two choices treat alike are built once

    def table(units: frozenset[str]) -> PlanGraph:
        if units not in recent:
            if len(recent) >= 2:
                recent.pop(next(iter(recent)))
            recent[units] = search.table(cap, mesh, units, work)
            least[units] = least_memory(recent[units])
        return recent[units]

    def fits(units: frozenset[str]) -> bool:
        if units not in least:
            table(units)
        return budget is None or least[units] <= budget

    def cut() -> float | None:
        c = now(incumbent) if objective == "time" else None
        if best is not None:
            mine = best.step_time_s if objective == "time" else best.solution.objective
            c = mine if c is None else min(c, mine)
        return c

    def bounded(g: PlanGraph) -> Pruned | None:
        """``Pruned`` when the lower bound of ``g``'s unbudgeted problem reaches the cut."""
        if (c := cut()) is None:
            return None
        if floor is not None and floor >= c:
            return Pruned(floor, c)
        p = to_problem(g, objective)
        return Pruned(bound, c) if (bound := lower_bound(reduce(p), p)) >= c else None

    chains = recompute_choices(cap)
    plain = table(frozenset())
    if (p := bounded(plain)) is not None:
        raise p  # recomputing anything only adds time to every plan of this mesh
    if budget is not None and floor is None:
        free = _solve_free(plain, search, cut())
        if free.memory <= budget:
            return free  # the fastest plan of every choice, and it fits
        floor = free.solution.bound
    if budget is not None and (c := cut()) is not None and chains[0][-1]:
        if (p := budget_bound(plain, table(chains[0][-1]), objective, budget, c)) is not None:
            raise p  # no recomputation choice fits a plan of this mesh that beats the cut
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
        for units in chain[lo:]:
            g = table(units)
            if (p := bounded(g)) is not None:
                pruned = p
                break  # this chain's later choices cannot beat the best plan (or another mesh's)
            c = cut()
            try:
                r = solve_table_on(g, search, c if objective == "time" else None, units)
            except MemoryBudgetError as e:
                misfits.append(e)
                continue
            except Pruned as e:
                pruned = e
                continue
            except SearchError:  # no plan found in time
                continue
            say(f"mesh {mesh}: recompute {len(units)} units: {r.value(objective):.4g} ({objective})")
            if best is None or r.value(objective) < best.value(objective):
                best = r
    if best is None:
        if pruned is not None:
            raise pruned
        if misfits:
            raise min(misfits, key=lambda e: e.least)
        raise SearchError(f"no plan found on mesh {mesh} with any recomputation in the time limit")
    return best


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
    return lower_bound(reduce(r), r) - lam * q.budget


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
    """
    with gc_paused():  # one cyclic collection at the end, not one per table built (seconds each at scale)
        return _plan(model, example_inputs, devices, options, baselines, captured, progress, example_kwargs,
                     option_fields)


def _plan(model: torch.nn.Module | None, example_inputs: tuple | dict | torch.Tensor, devices: int | None,
          options: PlanOptions | None, baselines: bool, captured: Captured | None,
          progress: Callable[[str], None] | None, example_kwargs: dict[str, Any] | None,
          option_fields: dict[str, Any]) -> Plan:
    say = progress or (lambda line: None)
    opts = merge_options(options, devices=devices, **option_fields)  # every option checked there
    mesh = Mesh(opts.mesh) if opts.mesh else None
    devices, objective, precision, recompute = opts.world, opts.objective, opts.precision, opts.recompute
    profile = opts.profile if isinstance(opts.profile, Profile) else load_profile(opts.profile)
    search = Search(with_collectives(profile, opts.collectives), opts, budget_bytes(opts.memory_gb))
    prof, budget = search.profile, search.memory_bytes
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
    estimate: dict[Mesh, float] = {}  # what each mesh searched reached (its plan's value, else its bound)

    def rank(r: Result) -> tuple[float, int]:  # the best mesh: cheapest, then fewest axes
        return r.value(objective), r.graph.mesh.ndim

    jobs = opts.jobs if opts.jobs is not None else default_jobs(len(cap.graph.nodes), len(meshes))

    def record(m: Mesh, outcome: Result | BaseException) -> None:
        """A mesh's plan kept in ``results``, or why there is none recorded."""
        estimate[m] = (outcome.bound if isinstance(outcome, (_Floor, Pruned)) else
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
                               lambda g: solve_table(g, objective, "ilp", opts.time_limit_s), budget,
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
                                        (price_base, got_base) if baselines and not priced else None):
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
            raise _Floor(free.solution.bound)
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
    out = to_plan(cap, best, objective, prof.name, devices, base, seconds, opts.solver, results, best.recompute)
    out.collectives = opts.collectives
    out.meshes += pruned
    out.local_batch = opts.local_batch
    out.gpus_per_node = opts.gpus_per_node
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
    """``_plan``'s first pass: this mesh's fastest plan does not fit; ``bound`` bounds every plan of it."""

    def __init__(self, bound: float) -> None:
        super().__init__(bound)
        self.bound = bound


def solve_table(g: PlanGraph, objective: str, solver: str = "ilp", time_limit_s: float = 60.0) -> Result:
    """Solve a table already built (a baseline's restricted one) as ``solve_on`` solves its own, with
    no memory budget and no layers tied."""
    return solve_table_on(g, Search(g.profile, PlanOptions(objective=objective, solver=solver,
                                                           time_limit_s=time_limit_s, tie_layers=False)))


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
    nodes: dict[str, dict[str, list[list[Any]]]] = {}
    for v, c in zip(g.vars, sol.choice):
        st = v.strategies[c]
        if v.kind in ("param", "buffer"):
            params[v.fqn] = [str(p) for p in st.outputs[0]]
        elif v.kind == "input":
            inputs[v.name] = [str(p) for p in st.outputs[0]]
        elif v.kind == "op":
            nodes[v.name] = {"in": [[str(p) for p in t] for t in st.inputs],
                             "out": [[str(p) for p in t] for t in st.outputs]}
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
              "compute_s": float(r.compute_s), "hidden_s": float(r.hidden_s), "memory_bytes": float(r.memory)},
        baselines=baselines,
        solver={"name": sol.solver if solver != "brute" else "brute", "status": sol.status, "seconds": seconds,
                "objective": sol.objective, "bound": sol.bound,
                "gap": 0.0 if sol.status == "optimal" else relative_gap(sol.objective, sol.bound)},
        meshes=[{"mesh": list(x.graph.mesh.shape), "objective": x.value(objective)} for x in all_results],
        fallback_ops=g.fallback_ops, layers=layer_rows(g, sol), memory=memory_breakdown(g, sol),
        precision=cap.precision, recompute=sorted(recompute), reshards=reshard_records(g, sol.choice),
        tying={"used": bool(r.runs), "runs": [x.record() for x in r.runs],
               "variables": [len(g.vars), len(g.vars) - sum(len(b) for x in r.runs for b in x.blocks[1:])]},
        keys=[[n, k] for n, k in cap.keys.items() if n in nodes],
    )


def with_collectives(profile: Profile, collectives: str) -> Profile:
    """``profile`` restricted to the collective algorithms ``collectives`` allows: ``auto`` every one (or the
    profile's own list), else the one named (``ir.algorithms.ALGORITHMS``)."""
    if collectives == "auto":
        return profile
    return replace(profile, algorithms=(check_algorithm(collectives),))


