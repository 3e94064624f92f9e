"""The planning pipeline: capture -> annotate/enumerate -> cost -> solve -> Plan.

``plan`` runs it for every candidate mesh shape (the factorisations of the
device count into 1-3 axes, unless a mesh is given) and keeps the cheapest
under the objective; it also prices the baselines a practitioner would choose
(data parallel, model parallel, FSDP, TP x FSDP, Megatron TP x DP), each the
same table restricted and solved the same way (``soybean.planner.baselines``).
``mode="dp" | "mp"`` forces the first two's layouts on the plan itself.
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..capture.core import Captured, CaptureError, capture, split_example
from ..cost.memory import budget_bytes
from ..cost.profiles import Profile, load_profile
from ..graph import (
    OUTPUT,
    PINNED,
    PlanGraph,
    gc_paused,
)
from ..ir.algorithms import check as check_algorithm
from ..mesh import Mesh, factorizations
from ..options import PlanOptions, options as merge_options, plan_kind
from ..plan import Plan
from ..precision import policy
from ..rules.datadep import data_dependent_warning
from ..search import Pruned, SearchError, relative_gap
from ..tiling import Replicate
from . import route_cache
from .baselines import price as price_baselines
from .mesh_pool import FEW_PER_WORKER, default_jobs, each_mesh
from .recompute import budget_hints, recompute_units, solve_plain, solve_recompute
from .records import context_parallel_records, layer_rows, memory_breakdown, moe_records, reshard_records
from .solve import (
    Incumbent,
    MemoryBudgetError,
    PlannerRun,
    Result,
    Search,
    SearchStopped,
    now,
    peaked,
    solve_on,
    solve_table,
)

# ``replicated``: the optimum with every parameter stored whole on every device (its use still split where that
# pays), as the torch.compile backend runs plans on the user's own parameters (``soybean.compile``).


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
    cutoff: float | None = None,
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
    ``cutoff``: a step time already reached another way (``api.auto_plan``: a pipelined plan's) that every mesh's
    search prunes by, as by a plan of another mesh; when no mesh finds a plan under it, ``Outclassed`` says so
    with the least bound, and the baselines (a run in which no mesh fits any plan raises ``MemoryBudgetError``).
    """
    with gc_paused():  # one cyclic collection at the end, not one per table built (seconds each at scale)
        return _plan(model, example_inputs, devices, options, baselines, captured, progress, example_kwargs,
                     option_fields, cache_routes, cutoff)


def _plan(model: torch.nn.Module | None, example_inputs: tuple | dict | torch.Tensor, devices: int | None,
          options: PlanOptions | None, baselines: bool, captured: Captured | None,
          progress: Callable[[str], None] | None, example_kwargs: dict[str, Any] | None,
          option_fields: dict[str, Any], cache_routes: bool = False, cutoff: float | None = None) -> Plan:
    say = progress or (lambda line: None)
    opts = merge_options(options, devices=devices, **option_fields)  # every option checked there
    if plan_kind(opts) != "plain":  # a front end's choice (``options.plan_kind``): planned here, it would be dropped
        raise ValueError(f"soybean.plan makes one program over every device, not pipeline={opts.pipeline!r} or "
                         f"placement={opts.placement!r}: soybean.parallelize and `soybean plan` plan those")
    mesh = Mesh(opts.mesh) if opts.mesh else None
    devices, objective, precision, recompute = opts.world, opts.objective, opts.precision, opts.recompute
    profile = opts.profile if isinstance(opts.profile, Profile) else load_profile(opts.profile)
    run = PlannerRun()  # what this run learns as it goes, dropped with it
    search = Search(with_collectives(replace(profile, expert_imbalance=opts.expert_imbalance), opts.collectives), opts,
                    budget_bytes(opts.memory_gb), run)
    prof, budget = search.profile, search.memory_bytes
    loaded = route_cache.load(run.pricing) if cache_routes else None

    def keep_routes() -> None:  # this process's walks stored for the next run (``route_cache``)
        if loaded is not None:
            route_cache.save(run.pricing, loaded)

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
    found = _Outcomes(objective, search, say)
    jobs = opts.jobs if opts.jobs is not None else default_jobs(len(cap.graph.nodes), len(meshes))

    def price_base(tell: Callable[[str], None]) -> dict[str, dict[str, Any]]:
        """The baselines (``soybean.planner.baselines``): on a worker once out of meshes, else after the search."""
        tell("baselines")
        return price_baselines(cap, devices, prof, objective,
                               lambda g: solve_table(g, objective, "ilp", opts.time_limit_s, opts.tie_layers), budget,
                               opts.gpus_per_node, run.pricing, opts.outputs == "lazy")

    def each(ms: Sequence[Mesh], solve_mesh: Callable[[Mesh, Incumbent, Callable[[str], None]], Result],
             staged: bool = False) -> None:
        """``solve_mesh`` on every mesh of ``ms`` (on ``jobs`` processes, ``mesh_pool``), each outcome recorded.
        ``staged``, with many meshes of three axes (more than ``mesh_pool.FEW_PER_WORKER`` per worker): the meshes
        of at most two axes first, with the baselines beside them (``price_base``), then the others in the order of
        ``by_promise``, on what the first stage found."""
        low, high = [m for m in ms if m.ndim < 3], [m for m in ms if m.ndim >= 3]
        stages = [low, high] if staged and low and len(high) > FEW_PER_WORKER * jobs else [list(ms)]
        for stage in stages:
            known = [r.step_time_s for r in found.results] + ([cutoff] if cutoff is not None else [])
            incumbent = min(known, default=None) if objective == "time" else None
            for m, outcome in each_mesh(by_promise(stage, found.estimate) if staged else stage, solve_mesh, _light,
                                        lambda r: r.step_time_s if objective == "time" else None, jobs, say,
                                        (SearchError, _Floor), incumbent,
                                        (price_base, found.got_baselines)
                                        if baselines and found.baselines is None else None,
                                        keep_routes if loaded is not None else None):
                found.record(m, outcome)

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
            raise _Floor(free.solution.bound, free.value(objective), free.solution.choice)
        return free

    if recompute == "auto" and budget is not None and objective == "time":
        each(meshes, plain, staged=True)
        meshes = sorted(found.floors, key=found.floors.__getitem__)

    def searched(m: Mesh, incumbent: Incumbent, tell: Callable[[str], None]) -> Result:
        tell(f"mesh {m}: build and solve")
        if recompute != "auto":
            return solve_on(cap, m, search, incumbent, rec)
        floors = found.floors
        if m in floors and (cut := now(incumbent)) is not None and floors[m] >= cut:
            raise Pruned(floors[m], cut)
        return solve_recompute(cap, m, search, incumbent, tell, floors.get(m), found.frees.get(m) or None)

    each(meshes, searched, staged=not found.floors)
    if not found.results and cutoff is not None and (found.pruned or found.failed):
        if baselines and found.baselines is None:
            found.got_baselines(price_base(say))
        unbounded = len(found.failed) > len(found.stopped)  # a search that found neither a plan nor a bound
        low = min([r["bound"] for r in found.pruned] + list(found.stopped) + ([-math.inf] if unbounded else []))
        raise Outclassed(low, cutoff, found.baselines or {})
    if not found.results:
        if found.misfits and not found.failed:
            least = min(found.misfits, key=lambda e: e.least)
            raise least.with_hints(budget_hints(cap, model, example_inputs, example_kwargs, search,
                                                [e.mesh for e in found.misfits], recompute))
        raise found.failed[0]
    best = min(found.results, key=found.rank)
    if (low := run_bound(found.results, found.stopped, objective)) < best.solution.bound:
        # a mesh left unsearched, or searched to its time limit, may hold a faster plan: the least bound counts
        best.solution = replace(best.solution, bound=low, status="feasible")
    if best.step_time_s >= PINNED or best.comm_bytes >= PINNED:  # only a forced layout pins (``mode`` dp or mp)
        # The plan runs (and trains as serial): it leaves the forced layout where the model needs it to, and that
        # step carries the layout's penalty, so its modelled figures mean nothing.
        warnings.warn(f"soybean: mode {opts.mode!r} on mesh {best.graph.mesh}: the forced layout cannot run this model "
                      "as it is (a batch that leaves some device no rows, or a parameter used unlike it is stored), "
                      "so the plan leaves it where needed and its modelled cost is the layout's penalty, not a time; "
                      "use mode='auto', or a batch every device gets rows of", stacklevel=3)
    # A worker sends a plan without its table only when another plan, sent whole, was at least as good (``_light``).
    assert best.graph.vars, f"mesh {best.graph.mesh}: the best plan came from a worker without its table"
    seconds = time.perf_counter() - t0
    if baselines and found.baselines is None:
        found.got_baselines(price_base(say))
    if best.graph.fallback_ops:
        warnings.warn(
            f"soybean: no sharding rule for {', '.join(best.graph.fallback_ops)}; these ops run replicated",
            stacklevel=2,
        )
    if best.graph.data_dependent:
        warnings.warn(data_dependent_warning(best.graph.data_dependent), stacklevel=2)
    out = to_plan(cap, best, opts, prof.name, found.baselines or {}, seconds, found.results, found.pruned)
    keep_routes()
    return out


class _Outcomes:
    """What ``_plan`` learns of its meshes as their outcomes arrive (``record``): the plans found (``results``), the
    meshes no plan fits (``misfits``), those whose search failed (``failed``) and those pruned unsolved
    (``pruned``: the plan's ``meshes`` rows), the bound of each mesh whose fastest plan does not fit (``floors``),
    what each mesh searched reached (``estimate``, for ``by_promise``), and the baselines once priced (None before).
    Each ``_plan`` call makes its own."""

    def __init__(self, objective: str, search: Search, say: Callable[[str], None]) -> None:
        self.objective, self.search, self.say = objective, search, say
        self.results: list[Result] = []
        self.misfits: list[MemoryBudgetError] = []
        self.failed: list[SearchError] = []
        self.stopped: list[float] = []  # the bounds of the meshes whose search stopped at its time limit without a plan
        self.pruned: list[dict[str, Any]] = []
        self.floors: dict[Mesh, float] = {}  # a mesh's plain plan's bound, where that plan does not fit the budget
        self.frees: dict[Mesh, tuple[int, ...]] = {}  # ... and that plan
        self.estimate: dict[Mesh, float] = {}  # what each mesh searched reached: its plan's value (inf: no plan)
        self.baselines: dict[str, dict[str, Any]] | None = None

    def rank(self, r: Result) -> tuple[float, int]:
        """The best mesh: cheapest, then fewest axes."""
        return r.value(self.objective), r.graph.mesh.ndim

    def got_baselines(self, records: dict[str, dict[str, Any]]) -> None:
        self.baselines = records

    def record(self, m: Mesh, outcome: Result | BaseException) -> None:
        """A mesh's plan kept in ``results``, or why there is none recorded."""
        objective, say, run = self.objective, self.say, self.search.run
        # from above, for ``by_promise``: a plan's value, also one that does not fit the budget; no plan, none (a
        # pruned mesh's bound is from below: on 64 devices it put two children of a pruned 2x32 first, 10 s each)
        self.estimate[m] = (outcome.value if isinstance(outcome, _Floor) else
                            outcome.value(objective) if isinstance(outcome, Result) else math.inf)
        if isinstance(outcome, _Floor):
            self.floors[m], self.frees[m] = outcome.bound, outcome.choice
            say(f"mesh {m}: its fastest plan needs recomputation or more memory: bound {outcome.bound:.4g}")
        elif isinstance(outcome, MemoryBudgetError):
            self.misfits.append(outcome)
            say(f"mesh {m}: no plan fits the memory budget")
        elif isinstance(outcome, Pruned):  # proven no better than a mesh already solved
            self.pruned.append({"mesh": list(m.shape), "bound": outcome.bound, "pruned": True})
            say(f"mesh {m}: lower bound {outcome.bound:.4g} is no better than the best so far: not solved")
        elif isinstance(outcome, SearchStopped):  # no plan in its time, but a bound: the plan's must count it
            self.failed.append(outcome)
            self.stopped.append(outcome.bound)
            say(f"mesh {m}: no plan found in the time limit, bound {outcome.bound:.4g}")
        elif isinstance(outcome, SearchError):  # this mesh found no plan in its time: the others still count
            self.failed.append(outcome)
            say(f"mesh {m}: no plan found ({outcome})")
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            outcome.graph.pricing = run.pricing  # a worker's table comes without it
            peaked(self.search, outcome)  # where the next stage's workers start their cap searches
            self.results.append(outcome)
            sol = outcome.solution
            lead = min(self.results, key=self.rank)
            for r in self.results:  # only the best mesh's tables are read again: free the others' (GBs at 64 devices)
                if r is not lead and r.graph.vars:
                    r.graph = PlanGraph(r.graph.mesh, r.graph.profile, pricing=run.pricing)
            say(f"mesh {m}: {outcome.value(objective):.4g} ({objective}), "
                f"gap {relative_gap(sol.objective, sol.bound):.2%}")


class Outclassed(Pruned):
    """No mesh found a plan under ``plan``'s ``cutoff``: each was pruned by it, fits no plan, or found none in its
    time.  ``bound``: the least bound of what was searched (``-inf`` where a search found neither a plan nor a
    bound; at least ``cutoff`` where every mesh was pruned or fits none: proven); ``baselines``: the run's records
    of them, priced all the same."""

    def __init__(self, bound: float, cutoff: float, baselines: dict[str, dict[str, Any]]) -> None:
        super().__init__(bound, cutoff)
        self.baselines = baselines
        self.args = (f"no mesh found a plan under the cutoff {cutoff:.6g} (least bound {bound:.6g})",)


def run_bound(results: Sequence[Result], stopped: Sequence[float], objective: str) -> float:
    """The lower bound of every plan of a run: the least of each mesh's, those searched (a search that stopped at
    its time limit or at another mesh's plan returns its best plan with the bound of what it left, which may lie
    below the run's best plan: Mixtral-8x7B on 64 devices reported 8x2x4 at 1,007.2 ms with gap 0 while 8x4x2,
    stopped at 1,008.8 ms, holds a plan of 1,004.4 ms) and those stopped without a plan (``stopped``).  Pruned
    meshes are left out: each bound reached the plan that pruned it.  The searched meshes' bounds count under
    ``time`` only, where they are in the unit plans are ranked by (a step time): under ``comm`` a solve bounds its
    problem's bytes with the seconds that break ties, not the bytes its plan is ranked by (``planner.evaluate``)."""
    searched = [r.solution.bound for r in results] if objective == "time" else []
    return min(searched + list(stopped), default=math.inf)


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
    is the plan's step (inf: none found), an estimate from above of the mesh's plans without a budget, ``choice``
    the plan (``solve_recompute``'s ``free``)."""

    def __init__(self, bound: float, value: float = math.inf, choice: Sequence[int] = ()) -> None:
        super().__init__(bound, value, choice)  # all, so a worker's pickled copy is rebuilt whole
        self.bound, self.value, self.choice = bound, value, tuple(choice)


def to_plan(cap: Captured, r: Result, opts: PlanOptions, profile: str, baselines: dict, seconds: float,
            all_results: Sequence[Result], pruned: Sequence[dict[str, Any]] = ()) -> Plan:
    """The plan of result ``r`` (the best mesh's) of ``cap``, whole: made once, never patched after.  ``opts``: the
    run's options (devices, objective, solver, contract, topology and collectives are recorded from them);
    ``profile``: the profile's name; ``baselines``: their records; ``seconds``: the search's time; ``all_results``:
    every mesh solved, and ``pruned``, every mesh pruned unsolved (``meshes``' rows, in that order)."""
    devices, objective, solver = opts.world, opts.objective, opts.solver
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
        elif v.kind == "output" and any(not isinstance(p, Replicate) for t in st.inputs for p in t):
            nodes[OUTPUT] = {"in": [[str(p) for p in t] for t in st.inputs], "out": []}  # left split, lazily read
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
        meshes=[{"mesh": list(x.graph.mesh.shape), "objective": x.value(objective)} for x in all_results]
        + [dict(x) for x in pruned],
        fallback_ops=g.fallback_ops, layers=layer_rows(g, sol), memory=memory_breakdown(g, sol),
        precision=cap.precision, recompute=sorted(r.recompute), reshards=reshard_records(g, sol.choice),
        tying={"used": bool(r.runs), "runs": [x.record() for x in r.runs],
               "variables": [len(g.vars), len(g.vars) - sum(len(b) for x in r.runs for b in x.blocks[1:])]},
        keys=[[n, k] for n, k in cap.keys.items() if n in nodes], moe=moe_records(g, sol),
        context_parallel=context_parallel_records(g, sol), collectives=opts.collectives,
        local_batch=opts.local_batch, gpus_per_node=opts.gpus_per_node, outputs=opts.outputs,
        inflight=opts.inflight,
    )


def with_collectives(profile: Profile, collectives: str) -> Profile:
    """``profile`` restricted to the collective algorithms ``collectives`` allows: ``auto`` every one (or the
    profile's own list), else the one named (``ir.algorithms.ALGORITHMS``)."""
    if collectives == "auto":
        return profile
    return replace(profile, algorithms=(check_algorithm(collectives),))
