"""Solving one mesh's table: the search's settings (``Search``) and what a run learns as it goes (``PlannerRun``),
a solve under the memory budget with the gradient sync's overlap capped by backward compute (``capped_overlap``),
the modelled cost of a solution (``evaluate``), and the least memory any plan of a table reaches
(``least_memory``, ``enough_memory``, ``MemoryBudgetError``)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..capture.core import Captured
from ..cost.memory import GIB, budget_needed
from ..cost.pricing import PricingCache
from ..cost.profiles import Profile
from ..graph import (
    NoStrategyLeft,
    PlanGraph,
    SharedWork,
    build,
    least_peak,
    phase_memory,
    phase_peaks,
)
from ..mesh import Mesh
from ..options import PlanOptions
from ..search import Hints, Infeasible, Pruned, Run, SearchError, Solution, relative_gap, solve
from ..tiling import R
from .baselines import batch_split, model_parallel_domains
from .mix import EXACT_TRIES, mixed, mixes
from .problem import to_problem
from .repeats import find_repeats

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
    """The placeholder restrictions of a forced ``mode`` (the layouts of two baselines, ``soybean.planner.baselines``)
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


@dataclass
class PlannerRun:
    """What one planner run learns as it goes: filled by its tables and solves (each mesh, each recomputation
    choice, the baselines), read by the later ones, and dropped with the run.  ``planner.core.plan`` makes one per
    call; a forked worker (``mesh_pool``) fills its own copy.

    ``pricing``: the run's ``cost.pricing.PricingCache``, shared by every table it builds; ``placed``: the profile
    on each mesh (``Profile.on_mesh``: which axes cross nodes), worked out once per mesh (``Search.on_mesh``);
    ``peaks``: each cap search's peak member (``Result.peak_mu``), the last one where the next mesh's starts
    (``capped_overlap``'s ``hint``); ``hints``: column generation's columns by problem shape (``search.columns``)."""

    pricing: PricingCache = field(default_factory=PricingCache)
    placed: dict[Mesh, Profile] = field(default_factory=dict)
    peaks: list[float] = field(default_factory=list)
    hints: Hints = field(default_factory=Hints)


@dataclass(frozen=True)
class Search:
    """How one planner run solves each mesh: its ``PlanOptions`` (objective, solver, mode, contract, time limit,
    topology, tying, gap: each read from there, never restated), the profile they name, loaded and restricted to
    the allowed collectives, the budget in bytes (``cost.memory.budget_bytes`` of ``memory_gb``), and ``run``, the
    state the run fills as it goes (``PlannerRun``).  The settings never change; ``run`` does, and a copy with
    other settings (``dataclasses.replace``: no budget, less time) shares it."""

    profile: Profile
    options: PlanOptions = PlanOptions()
    memory_bytes: float | None = None
    run: PlannerRun = field(default_factory=PlannerRun, repr=False, compare=False)

    def on_mesh(self, mesh: Mesh) -> Profile:
        """The run's profile on ``mesh`` (``Profile.on_mesh`` with the run's ``gpus_per_node``), kept in
        ``run.placed``."""
        placed = self.run.placed
        if mesh not in placed:
            placed[mesh] = self.profile.on_mesh(mesh, self.options.gpus_per_node)
        return placed[mesh]

    def repeats(self, g: PlanGraph) -> list[Run]:
        """The repeated layers of ``g`` this run's solves tie (``planner.repeats``): none with ``tie_layers`` off or
        the brute-force solver, which solves untied."""
        return find_repeats(g) if self.options.tie_layers and self.options.solver != "brute" else []

    def table(self, cap: Captured, mesh: Mesh, recompute: frozenset[str] = frozenset(),
              work: SharedWork | None = None) -> PlanGraph:
        """The candidate table of ``cap`` on ``mesh`` that ``solve_on`` solves (``work``: ``graph.SharedWork`` of
        the tables of other recomputation choices on ``mesh``)."""
        o = self.options
        try:
            return build(cap, mesh, self.on_mesh(mesh), objective=o.objective,
                         domains=_domains(cap, mesh, o.mode, o.local_batch), pin_params=o.mode in ("dp", "mp"),
                         local_outputs=o.local_batch, lazy_outputs=o.outputs == "lazy",
                         divide_work=True if o.mode in ("dp", "mp") else None,
                         recompute=recompute, pricing=self.run.pricing, work=work, context_parallel=o.context_parallel,
                         context_parallel_method=o.context_parallel_method, inflight=o.inflight)
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
                   recompute: frozenset[str] = frozenset(), settle: Callable[[Result], bool] | None = None,
                   runs: list[Run] | None = None) -> Result:
    """``solve_on``'s solve of a table already built (``MemoryBudgetError`` when no plan of it fits).  ``settle``:
    when it holds for member 0's plan (``capped_overlap``), that plan is returned as it is, its bound still a lower
    bound of every plan of ``g``.  ``runs``: ``g``'s repeated layers when the caller found them already."""
    objective, solver, memory_bytes = search.options.objective, search.options.solver, search.memory_bytes
    if memory_bytes is not None and least_memory(g) > memory_bytes:
        raise MemoryBudgetError(enough_memory(g), g.mesh)
    if runs is None:
        runs = search.repeats(g)

    def solved(mu: float = 0.0, phase: str = "activations", cutoff: float | None = None,
               enough: float | None = None) -> Result:
        ov = (1.0 - mu) * g.profile.grad_overlap
        problem = to_problem(g, objective, memory_bytes, overlap=ov, phase=phase, compute_credit=mu * BACKWARD_SHARE)
        r = evaluate(g, solve(problem, solver, search.options.time_limit_s, search.options.gap, runs, cutoff=cutoff,
                              enough=enough, hints=search.run.hints))
        r.runs = list(r.solution.runs) if r.solution.runs is not None else runs  # a mix: the stretches laid out alike
        r.recompute = recompute
        return r

    # The budget binds the activations phase.  Its solve holds each variable's memory less its rerun buffer, a
    # relaxation of the peak (``to_problem``): its bound bounds every plan that fits, and its plan, when it fits
    # the peak and the gradients phase, is the best that does.  A plan that breaks the peak (its rerun frees less
    # than its buffers, ``graph.rerun_freed``) is replaced by the best of the activations phase less only the
    # credit every plan's rerun frees, and one whose gradients phase breaks the budget by the best with both phases
    # summed: restrictions, whose solves' bounds and cutoffs hold for their plans only, so the result keeps the
    # relaxation's bound (measured: a 10-layer transformer, every layer recomputed, reported "optimal" at 70.4 ms
    # under the sum where a plan of 55.2 ms fits).
    r = solved(cutoff=now(incumbent))
    if memory_bytes is None or r.memory <= memory_bytes:
        if objective != "time" or (settle is not None and settle(r)):
            return r
        return peaked(search, capped_overlap(r, lambda mu, cut, need: solved(mu, "activations", cut, need),
                                              search.options.gap, incumbent, _hint(search), memory_bytes))
    relaxed = r.solution.bound  # below every plan that fits
    for phase in ("credited", "sum") if phase_peaks(g, r.solution.choice)[0] > memory_bytes else ("sum",):
        try:  # a restriction's bound that reaches the incumbent says only that none of its plans can beat it
            r = solved(phase=phase, cutoff=now(incumbent))
        except Pruned as e:
            raise SearchError(f"mesh {g.mesh}: no plan within the budget's restriction ({phase}) beats "
                              f"{e.cutoff:.4g}; the step's bound is {relaxed:.4g}") from None
        except Infeasible:  # the restriction holds no plan: no plan found, though not every plan is ruled out
            raise MemoryBudgetError(enough_memory(g), g.mesh) from None
        if r.memory <= memory_bytes:
            break
    if objective == "time" and not (settle is not None and settle(r)):
        try:
            r = peaked(search, capped_overlap(r, lambda mu, cut, need: solved(mu, phase, cut, need),
                                               search.options.gap, incumbent, _hint(search), memory_bytes))
        except Pruned:
            pass  # the restriction's members cannot beat the incumbent: its first plan stands, with the bound below
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
    peaks = search.run.peaks
    return peaks[-1] if peaks else None


def peaked(search: Search, r: Result) -> Result:
    """``r``, its cap search's peak kept in ``search.run.peaks`` for the next mesh's."""
    if r.peak_mu is not None:
        search.run.peaks.append(r.peak_mu)
    return r


def capped_overlap(first: Result, solved: Callable[[float, float | None, float], Result], gap: float,
                   incumbent: Incumbent = None, hint: float | None = None, budget: float | None = None) -> Result:
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
    carries ``T`` of its plan as objective and the best bound, its ``peak_mu`` the member of that bound.

    When the members end with the best plan still outside ``gap``, the plans they found on the two sides of the
    peak (``o S > b K`` and below) are mixed layer by layer (``planner.mix``: a run's first blocks from one, the
    rest from the other), the plans between the two sides no member finds; each mix is priced exactly and kept
    when it is faster and fits ``budget`` (Llama-3-8B returning its logits on 8x16x8, 1,024 devices: 379.3 ms at a
    2.2% gap -> 371.2 ms at 0.05%, layers 1-6 from one side and 7-30 from the other).  The bound is the members'."""
    o = first.graph.profile.grad_overlap

    def line(r: Result) -> tuple[float, float]:  # T_mu of r's plan = a + mu * slope
        a = r.comm_s + r.compute_s - o * r.sync_s
        return a, o * r.sync_s - r.cap_s

    best, bound, peak = first, first.solution.bound, 0.0
    lo, hi = line(first), None
    if lo[1] > 0:
        seen = {tuple(first.solution.choice)}
        found = [first]
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
                raise Pruned(max(bound, e.bound), cut if cut is not None else e.bound, e.free) from None
            if r.solution.bound > bound:
                bound, peak = r.solution.bound, mu
            if budget is None or r.memory <= budget:  # a member's budget is a relaxation of the peak
                best = min(best, r, key=lambda x: x.step_time_s)
            key = tuple(r.solution.choice)
            if key in seen and hi is not None:
                break  # found again where two lines cross: the envelope of the plans found is the dual at its peak
            seen.add(key)
            found.append(r)
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
        if relative_gap(best.step_time_s, bound) > gap:
            best = _mixed_best(best, found, line, budget)
    t, bound = best.step_time_s, min(bound, best.step_time_s)
    status = best.solution.status if relative_gap(t, bound) <= gap else "feasible"
    best.solution = replace(best.solution, objective=t, bound=bound, status=status)
    best.peak_mu = peak if lo[1] > 0 else None
    return best


def _mixed_best(best: Result, found: Sequence[Result], line: Callable[[Result], tuple[float, float]],
                budget: float | None) -> Result:
    """``best``, or the fastest mix (``planner.mix.mixes``) of a plan of ``found`` that hides less than it is
    credited with and one that hides all of it, priced exactly (``evaluate``) and within ``budget``."""
    above = [r for r in found if line(r)[1] > 0]
    below = [r for r in found if line(r)[1] <= 0]
    for a in above:
        for b in below:
            if a.graph is not b.graph or not a.runs:
                continue
            for t, choice, runs in mixes(a.graph, a.solution.choice, b.solution.choice, a.runs,
                                         BACKWARD_SHARE)[:EXACT_TRIES]:
                if t >= best.step_time_s:
                    break
                r = evaluate(a.graph, mixed(a.solution, choice))
                if budget is None or r.memory <= budget:
                    r.runs, r.recompute, r.peak_mu = runs, a.recompute, a.peak_mu
                    best = min(best, r, key=lambda x: x.step_time_s)
                    break
    return best


def least_memory(g: PlanGraph) -> float:
    """A lower bound of every plan's per-device memory: the larger of its two phases' (``graph.phase_memory``),
    each a sum of one term per variable, bounded by each variable's least term (the activations phase by
    ``graph.least_peak``, whose plans' reruns may free more than the ``rerun_credit`` all of them free).  No plan
    of ``g`` fits a budget below it."""
    return max(least_peak(g), float(sum(phase_memory(v, "gradients").min() for v in g.vars)))


def enough_memory(g: PlanGraph) -> float:
    """The memory a ``MemoryBudgetError`` names for ``g``: each phase's least, the activations' less only the
    ``rerun_credit`` every plan's rerun frees (``least_memory`` where nothing reruns); a plan fits it where one
    strategy of each variable is cheapest in both phases."""
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


class SearchStopped(SearchError):
    """A mesh's search reached its time limit before it found a plan; every plan of the mesh costs at least
    ``bound``, which the plan of the run counts in its own bound (``planner.core``: a mesh left unsearched is no
    proof that it holds nothing faster)."""

    def __init__(self, mesh: Mesh, bound: float) -> None:
        self.mesh, self.bound = mesh, bound
        super().__init__(f"mesh {mesh}: no plan found within the time limit (--time-limit); its plans' bound is "
                         f"{bound:.4g}")

    def __reduce__(self) -> tuple:  # rebuilt from its fields, not its message (a planner worker sends it)
        return (SearchStopped, (self.mesh, self.bound))


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


def solve_table(g: PlanGraph, objective: str, solver: str = "ilp", time_limit_s: float = 60.0,
                tie_layers: bool = True) -> Result:
    """Solve a table already built (a baseline's restricted one) as ``solve_on`` solves its own, with no memory
    budget, its repeated layers tied unless ``tie_layers`` is off (``search.tying``): every layer of a stack laid
    out alike, as experts run them and as the plan's own search ties them (Llama-3-8B's baselines on 64 devices:
    the same step times, each proven optimal, in 1.0 s of solves against 5.3 s untied)."""
    return solve_table_on(g, Search(g.profile, PlanOptions(objective=objective, solver=solver,
                                                           time_limit_s=time_limit_s, tie_layers=tie_layers)))
