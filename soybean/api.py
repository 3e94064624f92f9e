"""``soybean.parallelize``: capture -> plan -> lower -> ParallelModule, on every rank.

Called on every rank after ``torch.distributed.init_process_group`` (or under
``torchrun``, which it initialises from the environment).  Rank 0 captures the
model and plans, and sends both (the graph in the capture cache's stored form,
``_captured_once``; the plan as JSON), so ranks cannot diverge; every rank checks
that its model and example are rank 0's (names, shapes, dtypes) and the plan
against the graph (fingerprint, device count), and fails with a clear error
instead of hanging in a mismatched collective.  An error on any rank (capture,
planning, lowering) is raised on every rank (``runtime.agree``).
"""
from __future__ import annotations

import functools
import json
import math
import os
import pickle
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast, overload

import torch
import torch.distributed as dist

from .capture.core import Captured, CaptureError, capture, split_example
from .capture.functions import exported_with, kept_whole_by, own_backwards, pieces_or_whole
from .mesh import Mesh
from .options import PlanOptions, options as merge_options, plan_kind
from .plan import Plan
from .planner.core import plan as make_plan
from .precision import policy
from .run.microbatches import MicrobatchWarning, check as microbatch_check, difference as microbatch_difference
from .run.module import ParallelModule
from .run.optimizers import watch as watch_optimizers
from .run.pieces import CAPTURES, PiecesModule
from .run.pipelined import PipelinedModule
from .run.placed import PlacedModule
from .runtime.agree import SETUP_WAIT_S, agreed_setup, current_setup
from .runtime.comm import Group

# The other ranks wait this long for rank 0's plan (planning 1,024 devices takes minutes): over a group of its
# own (``runtime.agree.Setup``), so the collective timeout (``timeout_s``) can stay short.  A rank 0 that dies
# closes its connections, so the wait ends at once then.
PLAN_WAIT_S = SETUP_WAIT_S
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _resolve_plan(plan: Plan | str | Path | None) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    return Plan.load(plan)


def check_plan(p: Plan, fingerprint: str, world: int, precision: str | None = None) -> None:
    """Raise ``ValueError`` naming the mismatch when ``p`` cannot run here."""
    if p.devices != world:
        raise ValueError(f"plan is for {p.devices} devices but the world size is {world}: "
                         f"launch {p.devices} processes or re-plan with --devices {world}")
    if precision is not None and p.precision != precision:  # first: the graph of another precision differs too
        raise ValueError(f"plan computes in {p.precision} but precision={precision!r} was asked: re-plan with "
                         f"--precision {precision} or drop the argument")
    if p.fingerprint != fingerprint:
        raise ValueError("plan was made for another model or other input shapes (fingerprint "
                         f"{p.fingerprint} != {fingerprint}): re-run `soybean plan` for this model and batch")


def _watching(fn: F) -> F:
    """``parallelize`` whose module checks the optimizers stepped on it (``run.optimizers.watch``)."""
    @functools.wraps(fn)
    def parallelized(*args: Any, **kwargs: Any) -> Any:
        module = fn(*args, **kwargs)
        watch_optimizers(module)
        return module

    return cast(F, parallelized)


@overload
def parallelize(model: torch.nn.Module, example_inputs: tuple | dict | torch.Tensor, *, placement: str,
                **kwargs: Any) -> ParallelModule | PlacedModule: ...


@overload
def parallelize(model: torch.nn.Module, example_inputs: tuple | dict | torch.Tensor, *, pipeline: None = None,
                **kwargs: Any) -> ParallelModule: ...


@overload
def parallelize(model: torch.nn.Module, example_inputs: tuple | dict | torch.Tensor, *, pipeline: int,
                **kwargs: Any) -> PipelinedModule: ...


@overload
def parallelize(model: torch.nn.Module, example_inputs: tuple | dict | torch.Tensor, *, pipeline: str,
                **kwargs: Any) -> ParallelModule | PipelinedModule: ...


@_watching
@agreed_setup
def parallelize(model: torch.nn.Module, example_inputs: tuple | dict | torch.Tensor, *,
                options: PlanOptions | None = None, plan: Plan | str | Path | None = None, rank: int | None = None,
                groups: Sequence[Group] | None = None, captured: Captured | None = None, outputs: str | None = None,
                share_params: bool = False, example_kwargs: dict | None = None, timeout_s: float | None = None,
                capture_with: str = "auto", **option_fields: Any
                ) -> ParallelModule | PipelinedModule | PlacedModule | PiecesModule:
    """Parallelize ``model`` for the current process group (or the given simulated ``rank``/``groups``).

    ``example_inputs``: forward's positional arguments (a tuple, or one tensor), or a dict of its keyword
    arguments; ``example_kwargs``: more keywords.  The returned module is called the same way
    (``pm(input_ids, labels=labels)``), keywords in any order.

    How to plan is ``options`` (``soybean.options.PlanOptions``) with any of its fields as keywords on top
    (``devices=``, ``mesh=``, ``objective=``, ``profile=``, ``mode=``, ``memory_gb=``, ...), as
    ``soybean.plan`` takes them, and the kind of plan (``pipeline=``, ``microbatches=``, ``schedule=``,
    ``virtual_stages=``, ``placement=``: ``options.plan_kind``, as ``soybean plan`` chooses it); the ones that
    matter here:

    ``precision``: ``fp32`` or ``bf16-mixed`` (``soybean.precision``: bf16 compute from fp32 master weights,
    which are the module's parameters, so the optimizer updates fp32); default: the plan's, else fp32.

    ``recompute``: ``auto`` (default: recomputation decided with the tilings within ``memory_gb``, none without a
    budget), ``none``, ``layers`` or ``attention``, as ``soybean plan --recompute``.

    ``gpus_per_node``: devices per node; mesh axes whose groups cross nodes are priced at the profile's
    inter-node link (``h100-nvlink-ib``).

    ``mesh``: a shape such as ``(2, 2)`` (default: the planner picks).  ``plan``: a Plan or a path to
    its JSON.  ``mode``: ``auto`` (optimal), ``dp`` or ``mp`` (forced baselines).

    ``local_batch=True`` is the cheaper contract: ``example_inputs`` is still the global batch, but
    at run time each rank passes only its dim-0 slice (``pmodel.local_slice(x)``) and non-scalar
    outputs come back as this rank's tile (losses stay whole).  Nothing is sliced or gathered.  A loss
    computed outside on the tile trains as DDP does: the mean over ranks of their losses
    (``soybean.run.outputs.local_mean``).

    ``outputs`` (the full-batch contract; ``PlanOptions.outputs``): ``lazy`` (default) returns a split output as a
    ``soybean.run.outputs.LazyFull``, this rank's tile split along dim 0, gathered on first full read; a loss of
    ``torch.nn.functional`` on it reduces only the scalar.  ``full``: full tensors, gathered in the program.  The
    planner prices the one given: under ``lazy`` no gather of the logits a loop's loss reads.

    ``collectives``: the algorithm each collective runs, as ``soybean plan --collectives``: ``auto`` (the cheapest
    modelled for its group and message, ``cost.collectives.choose``), or one forced: ``backend`` (the backend's
    own calls), ``lp`` (chain pipelining), ``ring`` or ``tree`` (``runtime.algorithms``).  With ``plan=``, the
    plan's own choices run.

    ``share_params``: a parameter the plan stores whole is the model's own ``nn.Parameter`` object, not a copy,
    so an optimizer built on ``model.parameters()`` updates it (``soybean.compile``; fp32 only).

    ``timeout_s``: when this call initialises torch.distributed (under torchrun or ``soybean run``), how long a
    collective waits for a peer before failing: ``runtime.launch.collective_timeout`` (300 s, or
    ``$SOYBEAN_TIMEOUT_S``).  A process group the caller initialised keeps its own timeout.

    ``pipeline``: a number of pipeline stages (``None``, the default: one SPMD program over every device).  The
    model is captured at the microbatch (``example_inputs``' batch over ``microbatches``, default the number of
    stages), cut into stages of whole layers, each planned on its devices, and run by torch.distributed.pipelining
    with ``schedule`` (``gpipe``, ``1f1b`` (default); ``interleaved-1f1b`` or ``zero-bubble`` with ``virtual_stages``
    of 2 or more stages per rank, 2 when not given): a ``pipelined.PipelinedModule``, trained through
    ``pmodel.train_step(*inputs, loss_fn=fn)``; each stage runs on ``devices / pipeline`` devices.
    ``pipeline="auto"``: the faster of no stages and the best pipelined plan searched (``auto_plan``); the module
    is the one that plan runs as (``train_step`` serves both); with ``placement="auto"`` too, the plan without
    stages may place branches.  A number of stages with ``placement="auto"`` is refused (stages are planned without
    placement).

    ``placement``: ``"auto"`` lets independent branches of the graph (towers, Inception blocks) run at the same
    time on their own device groups, each group tiling its branches with its own plan (DLPlacer;
    ``placement_plan``), where modelled faster than the plan without placement; the module is then a
    ``placed.PlacedModule`` (inputs and outputs whole on every rank, ``loss.backward()`` on every rank).  ``"none"``
    (default; None too): every op on every device.  A plan saved with a placement runs as one.

    ``capture_with``: how the model is captured.  ``auto`` (default): ``torch.export``, and where export cannot
    capture the model (a graph break: data-dependent Python control flow, code that runs only when not compiling),
    dynamo in pieces split at its graph breaks, with one warning saying why (``soybean.run.pieces``); so too a model
    that calls a custom ``torch.autograd.Function`` whose backward is not its forward's derivative on the example
    (or cannot be checked there), which then runs as written between pieces, with its own backward (exported, it
    would train with its forward's derivative: ``capture.functions``; where pieces are not offered, a backward shown
    to differ is a ``CustomFunctionError``); ``export`` or ``dynamo``: only that one.  A model captured in
    pieces runs as a ``pieces.PiecesModule`` (the same API; every parameter stored whole, its use split; fp32, the
    full-batch contract, no pipeline stages or placement).  A plan saved from pieces runs as one.
    """
    if capture_with not in CAPTURES:
        raise ValueError(f"unknown capture_with {capture_with!r}: use one of {', '.join(CAPTURES)}")
    opts = merge_options(options, outputs=outputs, **option_fields)
    example_inputs, example_kwargs = split_example(example_inputs, example_kwargs)
    groups, rank, world = _world(opts, groups, rank, timeout_s)
    simulated = groups is not None
    p = _resolve_plan(plan)
    prec = policy(opts.precision).name if opts.precision is not None else (p.precision if p is not None else "fp32")
    kind, one = plan_kind(opts, p), opts.one_program()  # ``one``: what each planner of one program is given
    if kind == "auto":
        def searched() -> Plan:
            return auto_plan(model, example_inputs, example_kwargs, one, world, prec,
                             placement=opts.placement == "auto")

        p = searched() if simulated or world == 1 else _from_rank0(searched, rank)
        kind = plan_kind(opts, p)  # run as what the search chose: stages, placed regions or neither
    if kind == "pipelined":
        if simulated:
            raise ValueError("a pipelined plan runs on a torch.distributed process group (torchrun or soybean run), "
                             "not on simulated groups")
        return _pipelined(model, example_inputs, example_kwargs, opts, world, rank, prec, p, capture_with == "export")
    if p is not None and p.pieces is not None:
        capture_with = "dynamo"  # a plan saved from pieces runs as one
    why = "capture_with='dynamo' was asked"
    cap = None
    if captured is not None:
        cap = captured
    elif capture_with != "dynamo":
        try:
            cap = _captured_once(model, example_inputs, example_kwargs, prec, rank, world, simulated)
        except CaptureError as e:
            if capture_with == "export":
                raise
            why = str(e).split(". Fix:")[0]
    if cap is not None and cap.functions and captured is None:
        # The exported graph trains a custom Function's forward's derivative; in pieces it runs as written.  Rank 0
        # checks the backwards and every rank follows its answer (a check near its tolerance cannot split them).
        names = cap.functions

        def check() -> dict[str, bool]:
            return own_backwards(model, example_inputs, example_kwargs, names)

        own = check() if simulated or world == 1 else _rank0_value(check, rank)
        kept = kept_whole_by(capture_with, given_plan=p is not None, kind=kind, precision=prec,
                             simulated=simulated and world > 1)
        reason = pieces_or_whole(own, type(model).__name__, kept, capture_with == "export")
        if reason is not None:
            why, cap = reason, None
    if cap is None:
        return _pieces(model, example_inputs, example_kwargs, one, world, rank, simulated, prec, p, kind == "placed",
                       why)
    if kind == "placed":
        if simulated:
            raise ValueError("a placed plan runs on a torch.distributed process group (torchrun or soybean run), "
                             "not on simulated groups: drop placement= or launch processes")
        if p is None:
            p = _from_rank0(lambda: placed_or_plain(cap, world, one), rank) if world > 1 else \
                make_plan(None, (), world, options=one, baselines=False, captured=cap)
        if p.placement is not None:
            check_plan(p, cap.fingerprint, world, cap.precision)
            return parts_module(model, cap, p, rank, world)
    if p is None:
        def make() -> Plan:
            return make_plan(None, (), world, options=one, baselines=False, captured=cap)

        p = make() if simulated or world == 1 else _from_rank0(make, rank)
    check_plan(p, cap.fingerprint, world, cap.precision)
    if groups is None:
        from .runtime.comm import torch_groups

        groups = torch_groups(Mesh(tuple(p.mesh)))
    return ParallelModule(model, cap, p, rank, groups, lazy_outputs=opts.outputs == "lazy", share_params=share_params)


def _world(opts: PlanOptions, groups: Sequence[Group] | None, rank: int | None,
           timeout_s: float | None) -> tuple[Sequence[Group] | None, int, int]:
    """``parallelize``'s groups (None: torch.distributed's, initialised here from the environment when it is not
    yet), this rank and the world size, checked against ``opts``' devices and mesh.  One device and no launcher
    runs in this process, on a simulated group of one."""
    if groups is None and opts.devices == 1 and not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        from .runtime.comm import ThreadWorld

        groups, rank = ThreadWorld(Mesh((1,))).groups(0), 0
    if groups is None:
        if not dist.is_initialized():
            from .runtime.launch import init_from_env

            init_from_env(timeout_s=timeout_s)
        world, rank = dist.get_world_size(), dist.get_rank()
        current_setup().open()  # from here an error on any rank is raised on every rank (``runtime.agree``)
    else:
        world = 1
        for g in groups:
            world *= g.size
        if rank is None:
            raise ValueError("simulated groups need an explicit rank")
    if opts.devices is not None and opts.devices != world:
        raise ValueError(f"devices={opts.devices} but the world size is {world}: "
                         f"launch {opts.devices} processes or pass devices={world}")
    if opts.mesh is not None and Mesh(opts.mesh).size != world:
        raise ValueError(f"mesh {Mesh(opts.mesh)} has {Mesh(opts.mesh).size} devices but the world size is {world}")
    return groups, rank, world


def _pieces(model: torch.nn.Module, args: tuple, kwargs: dict, opts: PlanOptions, world: int, rank: int,
            simulated: bool, precision: str, given: Plan | None, placed: bool, why: str) -> PiecesModule:
    """``parallelize`` of a model captured by dynamo in pieces (``soybean.run.pieces``): plan on rank 0 (or read
    ``given``), every rank runs the model compiled with the pieces' plans.  ``placed``: placement was asked."""
    import warnings

    from .run.pieces import distinct, pieces_fingerprint, plan_pieces

    if precision != "fp32":
        raise ValueError(f"{type(model).__name__} is captured by dynamo in pieces ({why}), whose parameters are the "
                         f"model's own fp32 objects: precision {precision!r} is not offered there; train in fp32 or "
                         "make forward exportable")
    if placed:
        raise ValueError(f"{type(model).__name__} is captured by dynamo in pieces ({why}): placement is not offered "
                         "there; drop placement=")
    if simulated and world > 1:
        raise ValueError(f"{type(model).__name__} is captured by dynamo in pieces ({why}), which runs on a "
                         "torch.distributed process group (torchrun or soybean run), not on simulated groups")
    pm = PiecesModule(model, opts, parallelize)
    # Every rank collects, not only rank 0 which plans: dynamo's caches then hold the same entries on every rank
    # (it stops compiling a frame after ``recompile_limit`` entries, and a graph run as captured on one rank but as
    # a program on another would pair mismatched collectives).
    try:
        pieces = distinct(pm.collect(args, kwargs), pm.backend)
    except Exception as e:  # dynamo failed too (transformers' LongT5 transient-global fails under torch.compile)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CaptureError(f"could not capture {type(model).__name__}: torch.export failed ({why}) and so did dynamo "
                           f"({type(e).__name__}: {first}). Fix: run the model under torch.compile(model, "
                           "backend='eager') to see dynamo's error, and make that code path traceable") from e
    if given is None:
        def make() -> Plan:
            return plan_pieces(model, pieces, world, opts, why, _plan_piece)

        given = _from_rank0(make, rank) if world > 1 else make()
    elif given.pieces is None:
        raise ValueError("this plan was made from one exported graph, but the model is captured by dynamo in pieces "
                         f"({why}): plan again")
    else:
        mine = pieces_fingerprint([cap.fingerprint for _, cap in pieces])
        if mine != given.fingerprint:
            raise ValueError(f"plan was made for another model or other input shapes (fingerprint "
                             f"{given.fingerprint} != {mine}): re-run `soybean plan` for this model and batch")
    if given.devices != world:
        raise ValueError(f"plan is for {given.devices} devices but the world size is {world}: "
                         f"launch {given.devices} processes or re-plan with --devices {world}")
    pm.use(given)
    assert given.pieces is not None
    warnings.warn(f"soybean: {type(model).__name__} captured by dynamo in {len(given.pieces['graphs'])} pieces (split "
                  f"at graph breaks and custom Function calls), not by torch.export ({why}); "
                  "parameters are stored whole, the pieces' work is split", stacklevel=3)
    return pm


def _plan_piece(cap: Captured, opts: PlanOptions, world: int) -> Plan:
    """One piece's plan (``pieces.plan_pieces``): on every device, no baselines."""
    # A piece hands its outputs to the Python between pieces whole (``run.pieces``): priced as such.
    return make_plan(None, (), world, options=opts.merged(outputs="full"), baselines=False, captured=cap)


def placed_or_plain(cap: Captured, world: int, opts: PlanOptions, say: Callable[[str], None] = lambda line: None,
                    baselines: bool = False, cache_routes: bool = False) -> Plan:
    """``placement="auto"``: the faster of the plan without placement and the best placed plan
    (``placement_plan.plan_placement``); the plan without placement records the placed plan's step
    (``solver["placement_s"]``: None when the graph has no branches to place), a placed one the other's
    (``placement["without_placement_s"]``).  ``cache_routes``: as ``planner.plan``'s."""
    from .parts.placement_plan import plan_placement

    plain = make_plan(None, (), world, options=opts, baselines=baselines, captured=cap, cache_routes=cache_routes)
    say("placement")
    placed = plan_placement(cap, world, opts, say, cache_routes=cache_routes)
    # The plan returned records the other's step: a new Plan, the two planned ones left as they were made.
    if placed is None or placed.cost["step_time_s"] >= plain.cost["step_time_s"]:
        return replace(plain, solver={**plain.solver,
                                      "placement_s": None if placed is None else placed.cost["step_time_s"]})
    assert placed.placement is not None
    return replace(placed, placement={**placed.placement, "without_placement_s": plain.cost["step_time_s"]},
                   baselines=plain.baselines)


def parts_module(model: torch.nn.Module, cap: Captured, p: Plan, rank: int,
                 world: int) -> PipelinedModule | PlacedModule:
    """This rank's module of the plan in parts ``p``: its parts cut from ``cap`` as the plan records them
    (``parts.rebuild.parts_of``), a pipelined plan's stages as a ``PipelinedModule``, a placed plan's regions as a
    ``PlacedModule``."""
    from .parts.rebuild import parts_of

    parts, plans = parts_of(cap, p)
    kind = PipelinedModule if p.pipeline is not None else PlacedModule
    return kind(model, cap, parts, plans, p, rank, world)


def _pipelined(model: torch.nn.Module, args: tuple, kwargs: dict, opts: PlanOptions, world: int, rank: int,
               precision: str, given: Plan | None, exported: bool = False) -> PipelinedModule:
    """``parallelize`` with pipeline stages (its docstring): capture at the microbatch, plan ``opts.pipeline``
    stages on rank 0 (or read ``given``, a plan with stages: ``options.plan_kind``), every rank cuts the same
    stages and runs its own.  ``exported``: ``capture_with="export"`` was asked (a custom Function trains with its
    forward's derivative, warned: ``capture.functions.exported_with``)."""
    from .parts.pipeline_plan import plan_pipeline

    if given is not None:
        assert given.pipeline is not None  # ``plan_kind`` runs a given plan pipelined only when it has stages
        microbatches = int(given.pipeline["microbatches"])
    else:
        assert isinstance(opts.pipeline, int)
        stages, microbatches = opts.pipeline, opts.microbatches_for(opts.pipeline)
    margs, mkwargs, _ = micro_inputs(args, kwargs, microbatches)
    try:
        cap = _captured_once(model, margs, mkwargs, precision, rank, world, False)
    except CaptureError as e:  # what parallelize does without stages, said where a user reads it
        raise CaptureError(f"{e} (pipeline stages need one exported graph; without pipeline= and placement=, "
                           f"soybean.parallelize trains {type(model).__name__} captured by dynamo in pieces)") from e
    if cap.functions:  # rank 0's check, on every rank: each raises the same error or none does
        own = _rank0_value(lambda: own_backwards(model, args, kwargs, cap.functions), rank)
        exported_with(own, type(model).__name__, "in pipeline stages", exported)
    # Microbatches train the serial model only where its rows are independent: rank 0 runs the example whole and in
    # microbatches, and every rank raises the same ``MicrobatchError`` where they differ.
    microbatch_check(_rank0_value(lambda: microbatch_difference(model, args, kwargs, microbatches), rank),
                     type(model).__name__, microbatches)
    if given is None:
        given = _from_rank0(lambda: plan_pipeline(cap, world, stages, microbatches, opts.schedule, opts.one_program(),
                                                  opts.virtual)[2], rank)
    assert given.pipeline is not None
    if given.fingerprint != cap.fingerprint or given.devices != world:
        raise ValueError(f"the pipelined plan was made for another model, batch or world size (plan: {given.devices} "
                         f"devices, fingerprint {given.fingerprint}; here: {world}, {cap.fingerprint}): plan again")
    pm = parts_module(model, cap, given, rank, world)
    assert isinstance(pm, PipelinedModule)
    return pm


def _captured_once(model: torch.nn.Module, args: tuple, kwargs: dict, precision: str, rank: int, world: int,
                   simulated: bool) -> Captured:
    """``model`` captured on rank 0 and sent to every rank in the capture cache's stored form (``cache.dumps``), so
    every rank lowers the graph rank 0 planned, and a process group captures once: ``torch.export`` is most of a
    rank's set-up (on this 2-core box two ranks capturing at once took twice the CPU of one).  Every rank sends
    what its own model and example hold (``_signature``: names, shapes and dtypes, no values); a rank whose differ
    from rank 0's is named by the same ``ValueError`` on every rank, as a fingerprint of its own capture did.
    Rank 0's ``CaptureError`` is raised on every rank (each then takes the same path: pieces, or the error).  A
    capture the stored form cannot hold (a graph with submodule calls; a target another process cannot import) is
    made by each rank itself, as before.  Threads (``simulated``) and one process capture in place."""
    from .capture import cache

    if simulated or world == 1 or not dist.is_initialized():
        return capture(model, args, kwargs, precision=precision)
    mine: list[Captured] = []

    def make() -> tuple[str, Any]:
        try:
            mine.append(capture(model, args, kwargs, precision=precision))
        except CaptureError as e:  # sent as a value: every rank raises it, then goes on as rank 0 does
            return "failed", str(e)
        try:
            return "graph", cache.dumps(mine[0])
        except (TypeError, AttributeError, pickle.PicklingError):
            return "own", None

    setup = current_setup()
    setup.open()
    own = _signature(model, args, kwargs)
    try:
        sent = (make() if rank == 0 else None, own)
    except Exception as e:  # sent instead of the graph: the others are waiting for it
        setup.fail(e)
    got = setup.share(sent)
    (said, value), first = got[0]
    if differ := [r for r, (_, sig) in enumerate(got) if sig != first]:
        raise ValueError(f"rank(s) {differ} hold another model or example than rank 0 (parameter, buffer or input "
                         f"names, shapes or dtypes differ): every rank must build the same model and pass inputs of "
                         f"the same shapes to soybean.parallelize")
    if said == "failed":
        raise CaptureError(value)
    if mine:
        return mine[0]
    if said == "graph":
        try:
            return cache.loads(value)
        except Exception:  # a target this process cannot import (a class of its __main__): capture as rank 0 did
            pass
    return capture(model, args, kwargs, precision=precision)


def _signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """A digest of what a capture of ``model(*args, **kwargs)`` depends on besides values: every parameter's and
    buffer's name, shape, dtype and ``requires_grad``, and the example's structure (tensors by shape and dtype,
    other leaves by ``repr``)."""
    import hashlib

    from torch.utils._pytree import tree_flatten

    def leaf(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"T{tuple(x.shape)}{x.dtype}{x.requires_grad}"
        return repr(x) if isinstance(x, (int, float, bool, str, type(None))) else type(x).__qualname__

    leaves, spec = tree_flatten((args, kwargs))
    state = [f"{k}{tuple(t.shape)}{t.dtype}{t.requires_grad}"
             for k, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    text = "\n".join([*state, str(spec), *map(leaf, leaves)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _rank0_value(make: Callable[[], T], rank: int) -> T:
    """``make()`` on rank 0 (any picklable value), sent to every rank (so ranks cannot diverge) over the call's own
    gloo group (``runtime.agree.Setup``), whose timeout (``PLAN_WAIT_S``) covers planning.  An error instead of the
    value (rank 0's, or another rank's own capture failing before it got here) is raised on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    setup = current_setup()
    setup.open()
    try:
        mine = make() if rank == 0 else None
    except Exception as e:  # sent instead of the value: the others are waiting for it
        setup.fail(e)
    return setup.share(mine)[0]


def _from_rank0(make: Callable[[], Plan], rank: int) -> Plan:
    """Rank 0's plan on every rank (``_rank0_value``), sent as its JSON."""
    received = _rank0_value(lambda: make().to_json(), rank)
    assert received is not None  # rank 0 sent its plan
    return Plan.from_dict(json.loads(received))


def micro_inputs(args: tuple, kwargs: dict, microbatches: int) -> tuple[tuple, dict, int]:
    """The first ``batch / microbatches`` rows of every input whose dim 0 is the batch (the shapes a stage runs
    on), and the batch; a one-line error when the batch does not split into equal microbatches."""
    from .run.pipelined import check_microbatches

    batch = next((int(x.shape[0]) for x in [*args, *kwargs.values()] if isinstance(x, torch.Tensor) and x.dim()),
                 None)
    if batch is None:
        raise ValueError("pipeline stages split the batch into microbatches along dim 0, but no input has a dim 0")
    check_microbatches(batch, microbatches)
    rows = batch // microbatches

    def micro(x: Any) -> Any:
        return x[:rows] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x

    return tuple(micro(a) for a in args), {k: micro(v) for k, v in kwargs.items()}, batch


def auto_plan(model: torch.nn.Module, args: tuple, kwargs: dict, opts: PlanOptions, world: int,
              precision: str, say: Callable[[str], None] = lambda line: None, baselines: bool = False,
              placement: bool = False) -> Plan:
    """``pipeline="auto"``: the faster of the plan without stages (the whole batch on one mesh) and the best
    pipelined plan (``pipeline_plan.search_pipeline``); the plan without stages keeps every pipeline searched in
    ``solver["pipelines_searched"]``, a pipelined one in ``pipeline["searched"]`` with the other's step
    (``pipeline["without_stages_s"]``).  ``baselines``: the plan returned records every baseline, the one-mesh
    layouts (``soybean.planner.baselines``) and torchtitan's 3-D ones (``pipeline_baselines``).  ``placement``: the plan
    without stages may place branches on device groups (``placed_or_plain``).

    Which goes first: without a memory budget the plan without stages, whose step prunes the pipelines searched
    (stages rarely pay where memory does not bind); under a budget the pipelines, whose best step prunes the plan
    without stages (``planner.plan``'s ``cutoff``: each mesh's search stops at a bound that reaches it, where a
    mesh that needs recomputation searched to its end took minutes: Llama-3-70B on 64 devices).  A plan without
    stages pruned so is recorded by its bound (``pipeline["without_stages_bound_s"]``), its step left None.  Either
    order returns the faster of the two."""
    from .parts import pipeline_baselines
    from .parts.pipeline_plan import search_pipeline
    from .planner.core import Outclassed, SearchError
    from .planner.solve import MemoryBudgetError

    plain: Plan | None = None
    unfit: Exception | None = None
    outclassed: Outclassed | None = None
    base: dict[str, dict[str, Any]] = {}
    whole: Captured | None = None

    def without_stages(cutoff: float | None = None) -> None:
        nonlocal plain, unfit, outclassed, whole
        try:
            if whole is None:
                whole = capture(model, args, kwargs, precision=precision)
            plain = (placed_or_plain(whole, world, opts, say, baselines) if placement and world > 1 else
                     make_plan(None, (), world, options=opts, baselines=baselines, captured=whole, cutoff=cutoff))
            base.update(plain.baselines)
        except Outclassed as e:  # no mesh without stages can beat ``cutoff``
            outclassed = e
            base.update(e.baselines)
        except (MemoryBudgetError, SearchError) as e:  # no stages fit: only stages may
            unfit = e

    pipelines_first = opts.memory_gb is not None and not placement
    if not pipelines_first:
        without_stages()
    _, _, batch = micro_inputs(args, kwargs, 1)

    @functools.cache
    def capture_at(m: int) -> Captured:  # the search and the 3-D baselines capture at the same microbatches
        a, k, _ = micro_inputs(args, kwargs, m)
        return capture(model, a, k, precision=precision)

    # Stages run microbatches: where the model's rows are not independent they would train another model, so no
    # pipeline is searched (checked at the fewest microbatches the search would try; ``_pipelined`` checks the count
    # a plan runs with).
    fewest = next((m for m in range(2, batch + 1) if batch % m == 0), None)
    if fewest is not None and (why := microbatch_difference(model, args, kwargs, fewest)) is not None:
        if pipelines_first:
            without_stages()
        if plain is None:  # no plan without stages fits either: stages with one microbatch may
            try:
                microbatch_check(why, type(model).__name__, fewest)
            except ValueError as e:
                raise e from unfit
        warnings.warn(f"pipeline='auto' searched no pipeline stages: {type(model).__name__} does not compute the same "
                      f"on microbatches as on the whole batch ({why})", MicrobatchWarning, stacklevel=2)
        assert plain is not None
        return replace(plain, solver={**plain.solver, "pipelines_searched": [], "no_pipeline": why}, baselines=base)
    if baselines:
        say("3-D baselines")
        base.update(pipeline_baselines.price(capture_at, batch, world, opts, say))
    piped, searched = search_pipeline(capture_at, batch, world, opts, say,
                                      incumbent=plain.cost["step_time_s"] if plain is not None else None)
    if pipelines_first:
        without_stages(piped.cost["step_time_s"] if piped is not None else None)
    # The plan returned records the search and every baseline: a new Plan, the planned ones left as they were made.
    if plain is not None and (piped is None or piped.cost["step_time_s"] >= plain.cost["step_time_s"]):
        return replace(plain, solver={**plain.solver, "pipelines_searched": searched}, baselines=base)
    if piped is None:
        assert unfit is not None
        raise unfit
    assert piped.pipeline is not None
    return replace(piped, pipeline={**piped.pipeline,
                                    "without_stages_s": plain.cost["step_time_s"] if plain is not None else None,
                                    **({"without_stages_bound_s": outclassed.bound}
                                       if outclassed is not None and math.isfinite(outclassed.bound) else {})},
                   baselines=base)
