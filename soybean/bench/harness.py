"""Training-step benchmark: serial, DDP, tensor parallel, FSDP2 and soybean's plans, in one run.

    python scripts/bench.py examples.models:mlp --devices 2 --arg hidden=4096 --arg batch=32 --arg layers=2
    python scripts/bench.py MODEL --devices N [--arg key=value ...] [--steps 12] [--warmup 3] [--json]
                            [--profile NAME_OR_JSON|calibrate]

One training step is ``loss = model(*inputs)``, ``loss.backward()``, an AdamW step and
``zero_grad`` (the model factories return the loss when the target is among the inputs; any
other output is summed into a scalar).  Every variant builds the model and inputs from the same
factory call with the same seed.  The reported time is the median of ``--steps`` steps after
``--warmup`` untimed ones:

* ``serial``: this process, torch's default thread count;
* ``ddp``: ``DistributedDataParallel`` on N gloo processes, each with its dim-0 slice of every input;
* ``tp``: ``parallelize_module`` with a Megatron plan: the ``nn.Linear`` modules in order, alternately
  ``ColwiseParallel`` and ``RowwiseParallel`` (an odd last one stays replicated), inputs replicated;
* ``fsdp``: FSDP2 ``fully_shard`` on every Linear/Conv module and then the root, batch split;
* ``pp``: torch.distributed.pipelining by hand, as an expert splits two stages: ``pipeline()`` cut at the middle
  layer of the model's repeated stack (``middle_layer``), one stage per rank, ``Schedule1F1B`` over 4
  microbatches (2 ranks only);
* ``soybean`` / ``soybean_dp`` / ``soybean_mp``: ``soybean.parallelize`` with the optimal plan
  (``objective="time"``, ``pipeline="auto"``: stages only where modelled faster) and the forced data- and
  model-parallel plans, full batch on every rank;
* ``soybean_pp``: soybean forced to 2 pipeline stages, its microbatches and cut searched
  (``pipeline_plan.search_pipeline``); pipelined plans train through ``train_step``, and the report's
  ``plans.<variant>.stages`` says how many stages each ran (1: none);
* ``soybean_local``: the optimal plan under the local-batch contract (DDP's);
* ``soybean_backend``: the optimal plan's tilings with every collective the backend's own call
  (``collectives="backend"``), against which ``soybean``'s choice of algorithms is paired.

Each variant is one row of ``variants.TABLE``.

The N ranks are spawned once and run every distributed variant in one process group, one
thread per rank.  By default the variants take turns after every timed step, so drift of a
shared machine favours none and step ``i`` of every variant ran in the same round; only when all
their training state would not fit in half of physical memory do they run one after the other
(``--rounds``).  Each timed step starts and ends with a barrier and is timed on rank 0.

From the paired steps the report judges soybean's prediction (``candidates.significance``): the
plan predicted fastest is ``confirmed`` when every other candidate's median step-time ratio to it
has its 95% interval above 1, ``contradicted`` when one lies below 1, else ``unresolved`` (within
the steps' scatter; more ``--steps`` narrow the intervals).  See :mod:`soybean.benchstats`.
soybean's plans are made once, in this process, before the spawn (exactly the call
``parallelize`` makes on rank 0), so a plan that cannot be made is a null with its reason rather
than a hang.  A variant that fails, or a full-batch variant whose first loss differs from the
serial one, reports null and the reason (a failure on some ranks only: the first error met, naming its
rank); the other variants still run.  A failure that leaves other ranks inside a collective ends that
process group: the variants are measured again in a new one without it (``timing.GroupBroken``).

Ratios are speedups: ``speedup vs serial = serial time / variant time`` (above 1 is faster).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from .. import models
from ..options import PlanOptions
from ..plan import Plan
from .args import DESCRIPTION, LOSS_STYLES, add_arguments, add_parser as bench_parser
from .report import format_table
from .stats import fastest_verdict, spearman
from .timing import (
    AGREE_GRACE_S,
    GroupBroken,
    Measurement,
    Prepared,
    Step,
    Unavailable,
    interleaved,
    measure,
    sequential,
    training_step,
)
from .variants import BY_NAME, DIST_VARIANTS, LOCAL_BATCH, REPLICATING, SERIAL, SOYBEAN_MODES, TABLE, VARIANTS

__all__ = ["BenchConfig", "VARIANTS", "auto_rounds", "training_state_bytes", "run_bench", "format_table", "spearman",
           "candidates", "tp_layout", "add_parser", "cmd_bench", "main"]

NOT_SELECTED = "not selected (--variants)"
# ``--profile calibrate``: run ``soybean calibrate`` just before timing and plan with its profile
# (a shared machine's speed drifts over minutes: a profile from earlier mispredicts by as much).
CALIBRATE = "calibrate"
LOSS_RTOL = 1e-3
_SHARDED_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark and how long."""

    model: str                                  # pkg.module:fn or path/file.py:fn
    devices: int
    args: dict[str, Any] = field(default_factory=dict)
    steps: int = 12
    warmup: int = 3
    profile: str = "cpu-gloo"
    timeout_s: float = 1800.0                   # for the whole spawned run
    lr: float = 1e-3
    seed: int = 0
    # None: auto_rounds; 0: turns after every step; 1: one after the other; n: steps/n at a time
    rounds: int | None = None
    variants: tuple[str, ...] = VARIANTS        # which to run; the others report "not selected"
    loss: str = "inside"                        # LOSS_STYLES
    # PlanOptions fields every soybean variant plans with (``--plan-option expert_imbalance=2``); a variant's own win
    plan_options: dict[str, Any] = field(default_factory=dict)
    # how long a rank whose variant failed waits for the others' reports before judging them stuck (``timing``)
    agree_grace_s: float = AGREE_GRACE_S

    @property
    def dist_variants(self) -> tuple[str, ...]:
        """The selected distributed variants, in :data:`DIST_VARIANTS` order."""
        return tuple(v for v in DIST_VARIANTS if v in self.variants)

    def validate(self) -> None:
        """Raise ``ValueError`` for settings that cannot run."""
        if self.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {self.devices}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.rounds is not None and self.rounds < 0:
            raise ValueError(f"--rounds must be >= 0, got {self.rounds}")
        if self.loss not in LOSS_STYLES:
            raise ValueError(f"--loss must be one of {', '.join(LOSS_STYLES)}, got {self.loss!r}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"--variants: unknown {', '.join(unknown) or '(none given)'}; "
                             f"choose from {', '.join(VARIANTS)}")
        from ..cost.profiles import load_profile

        if self.profile == CALIBRATE:
            if self.devices < 2:
                raise ValueError("--profile calibrate measures collectives: it needs --devices >= 2")
        else:
            load_profile(self.profile)


# ---- one training step -------------------------------------------------------------


def _load(cfg: BenchConfig) -> tuple[nn.Module, tuple]:
    """A fresh model and inputs from the factory, under the benchmark seed."""
    torch.manual_seed(cfg.seed)
    return models.load(cfg.model, cfg.args)


def outside_loss(cfg: BenchConfig, model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The loss a ``--loss outside`` step computes: the model's own ``loss_fn(output, target)``."""
    if cfg.loss == "inside":
        return None
    fn = getattr(model, "loss_fn", None)
    if not callable(fn):
        raise Unavailable(f"{type(model).__name__} has no loss_fn(output, target) for --loss outside")
    return fn


def _prepared(prepare: Callable[[nn.Module, tuple], Prepared], cfg: BenchConfig) -> Prepared:
    """A fresh model prepared for a variant, with the loss the step computes outside it (if any)."""
    model, inputs = _load(cfg)
    loss_fn = outside_loss(cfg, model)  # taken before a wrapper hides the model's methods
    return replace(prepare(model, inputs), loss_fn=loss_fn)


# ---- the variants ------------------------------------------------------------------


def batch_slice(inputs: tuple, rank: int, world: int) -> tuple:
    """This rank's dim-0 slice of every tensor input (``tensor_split``: uneven batches allowed)."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] < world:
                raise Unavailable(f"batch {x.shape[0]} is smaller than {world} ranks: nothing to split")
            x = x.tensor_split(world)[rank]
        out.append(x)
    return tuple(out)


def tp_layout(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel layout a practitioner would write: a Hugging Face model's own ``base_model_tp_plan``
    (its config's ``colwise``/``rowwise`` entries on ``nn.Linear`` modules: q, k, v column-wise and the output
    projection row-wise; experts and other styles left replicated); for any other model Megatron pairing, the
    ``nn.Linear`` modules in order, alternately ``colwise`` and ``rowwise``.

    With an odd count the last Linear is left out (it stays replicated).  Empty when the model has
    no Linear modules.
    """
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]
    hf = _hf_tp_plan(model, set(linears))
    if hf:
        return hf
    paired = linears[: len(linears) - len(linears) % 2]
    return {name: ("colwise" if i % 2 == 0 else "rowwise") for i, name in enumerate(paired)}


def _hf_tp_plan(model: nn.Module, linears: set[str]) -> dict[str, str]:
    """``tp_layout`` from the first module whose config carries transformers' ``base_model_tp_plan`` (keys relative
    to its base model, ``*`` a layer index)."""
    for prefix, m in model.named_modules():
        plan = getattr(getattr(m, "config", None), "base_model_tp_plan", None)
        if not plan:
            continue
        base = getattr(m, "base_model_prefix", "")
        root = ".".join(x for x in (prefix, base if hasattr(m, base) else "") if x)
        out: dict[str, str] = {}
        for key, style in plan.items():
            if style not in ("colwise", "rowwise"):
                continue
            pattern = re.compile(re.escape(f"{root}.{key}" if root else key).replace(r"\*", r"\d+") + "$")
            out.update({name: style for name in sorted(linears) if pattern.match(name)})
        return out
    return {}


@dataclass
class _Context:
    """What a distributed variant needs: its rank, the config, soybean's plans and a device mesh."""

    rank: int
    world: int
    cfg: BenchConfig
    plans: dict[str, Plan | str]

    @functools.cached_property
    def mesh(self) -> Any:
        """A 1-D CPU DeviceMesh over every rank (for TP and FSDP2), created on first use."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (self.world,))


def _prepare_serial(model: nn.Module, inputs: tuple) -> Prepared:
    return Prepared(model, inputs)


def _prepare_ddp(ctx: _Context, model: nn.Module, inputs: tuple) -> Prepared:
    from torch.nn.parallel import DistributedDataParallel

    return Prepared(DistributedDataParallel(model), batch_slice(inputs, ctx.rank, ctx.world))


def _prepare_tp(ctx: _Context, model: nn.Module, inputs: tuple) -> Prepared:
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

    layout = tp_layout(model)
    if not layout:
        raise Unavailable("no pair of nn.Linear layers to split column- then row-wise")
    styles: dict[str, ParallelStyle] = {name: ColwiseParallel() if kind == "colwise" else RowwiseParallel()
                                        for name, kind in layout.items()}
    try:
        model = parallelize_module(model, ctx.mesh, styles)
    except Exception as e:  # torch raises many kinds; all mean "this plan does not apply"
        raise Unavailable(f"parallelize_module failed: {type(e).__name__}: {e}") from e
    return Prepared(model, inputs)


def _prepare_fsdp(ctx: _Context, model: nn.Module, inputs: tuple) -> Prepared:
    from torch.distributed.fsdp import fully_shard

    wrapped = [name for name, m in model.named_modules() if name and isinstance(m, _SHARDED_MODULES)]
    for name in wrapped:
        fully_shard(model.get_submodule(name), mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return Prepared(model, batch_slice(inputs, ctx.rank, ctx.world))


def _prepare_soybean(variant: str, ctx: _Context, model: nn.Module, inputs: tuple) -> Prepared:
    import soybean

    plan = ctx.plans[variant]
    if not isinstance(plan, Plan):
        raise Unavailable(plan)
    example = inputs[:-1] if ctx.cfg.loss == "outside" else inputs  # the target is the loss's, outside the model
    pmodel = soybean.parallelize(model, example, devices=ctx.world, plan=plan)  # the plan carries its options
    if plan.pipeline is not None:  # trained through the schedule
        return Prepared(pmodel, inputs, train_step=pmodel.train_step)
    if variant in LOCAL_BATCH:  # each rank passes its slice (the target: as the first input is split)
        inputs = tuple(pmodel.local_slice(x, i if i < len(example) else 0) if isinstance(x, torch.Tensor) else x
                       for i, x in enumerate(inputs))
    return Prepared(pmodel, inputs)


# The hand-written pipeline's schedule: torch's 1F1B over 4 microbatches, the model cut at its middle layer.
PP_MICROBATCHES = 4


def middle_layer(model: nn.Module) -> str:
    """The module that starts the second half of the model's repeated stack (``hidden.24`` of 48): where an
    expert splits two stages by hand."""
    blocks = [name for name, _ in model.named_modules() if name and name.split(".")[-1].isdigit()
              and name.count(".") == min((n.count(".") for n, _ in model.named_modules()
                                          if n and n.split(".")[-1].isdigit()), default=0)]
    if len(blocks) < 2:
        raise Unavailable("no repeated stack of layers to cut in two")
    return blocks[len(blocks) // 2]


def _on_a_chain(model: nn.Module, example: tuple, layer: str) -> None:
    """``Unavailable`` when ``layer`` is one of the model's parallel branches (``regions.segments``: a tower of two):
    a two-stage cut there leaves stage 1 reading the model's input and stage 0's branch, which torch's
    ``pipeline()`` does not pass on (its ranks wait for each other for ever)."""
    from ..capture.core import capture
    from ..graph.units import node_module
    from ..parts.regions import segments

    cap = capture(model, example)
    by_name = {n.name: n for n in cap.graph.nodes}
    for seg in segments(cap):
        if seg.parallel and any(node_module(by_name[n]).startswith(layer) for n in seg.nodes):
            raise Unavailable(f"{layer} is one of the model's parallel branches: no two-stage cut of a chain there")


def _prepare_pp(ctx: _Context, model: nn.Module, inputs: tuple) -> Prepared:
    """torch.distributed.pipelining by hand: ``pipeline()`` cut at the middle layer (``SplitPoint.BEGINNING``),
    one stage per rank, ``Schedule1F1B`` over ``PP_MICROBATCHES``; the loss outside the model, on the last stage
    (``--loss outside``: torch's stages pass on only what the previous stage returns, not the target)."""
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    from ..run.pipelined import batch_loss

    if ctx.world != 2:
        raise Unavailable(f"the hand-written pipeline has 2 stages: {ctx.world} ranks")
    if ctx.cfg.loss != "outside":  # its stage 0 takes the model's inputs, and the last stage reads only stage 0's
        raise Unavailable("torch.distributed.pipelining passes the target to loss_fn on the last stage, not through "
                          "the model: run with --loss outside")
    example = inputs[:-1]
    batch = next((x.shape[0] for x in example if isinstance(x, torch.Tensor) and x.dim()), 0)
    if batch % PP_MICROBATCHES:
        raise Unavailable(f"batch {batch} does not split into {PP_MICROBATCHES} microbatches")
    micro = tuple(x[:batch // PP_MICROBATCHES] if isinstance(x, torch.Tensor) and x.dim() else x for x in example)
    _on_a_chain(model, micro, middle_layer(model))
    try:
        pipe = pipeline(model, mb_args=micro, split_spec={middle_layer(model): SplitPoint.BEGINNING})
        stage = pipe.build_stage(ctx.rank, torch.device("cpu"))
    except Unavailable:
        raise
    except Exception as e:  # torch's tracer refuses many models: the variant does not apply
        raise Unavailable(f"torch.distributed.pipelining could not split the model: {type(e).__name__}: {e}") from e
    fn = outside_loss(ctx.cfg, model)
    assert fn is not None
    schedule = Schedule1F1B(stage, PP_MICROBATCHES, loss_fn=fn)
    last = ctx.world - 1

    def train_step(*args: Any, loss_fn: Any = None, target: torch.Tensor | None = None) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if ctx.rank == 0:
            schedule.step(*args, return_outputs=False)
        else:
            schedule.step(target=target, losses=losses, return_outputs=False)
        return batch_loss(losses, ctx.rank == last, last)

    return Prepared(stage.submod, inputs, loss_fn=fn, train_step=train_step)


# How each variant wraps the model, by its row's ``prepare`` (``variants.TABLE``).
_PREPARE: dict[str, Callable[..., Prepared]] = {"ddp": _prepare_ddp, "tp": _prepare_tp, "fsdp": _prepare_fsdp,
                                                "pp": _prepare_pp}
_DIST_PREPARE: dict[str, Callable[[_Context, nn.Module, tuple], Prepared]] = {
    v.name: functools.partial(_prepare_soybean, v.name) if v.soybean else _PREPARE[v.prepare]
    for v in TABLE if v.name != SERIAL
}


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The part of a plan a reader compares: mesh, parameter tilings, placement (``placement_groups``: the most
    device groups one segment's branches run on, 1 without; each region's modules, ranks and mesh), pipeline
    stages (the pipeline's depth, its
    rank groups: 1 without; a pipelined plan's schedule, virtual stages per group and every stage with its layers,
    ranks and mesh), and its routed experts (``moe``: per MoE layer the axes splitting its experts, their degree,
    where the rows move by all-to-all, those splitting each expert inside along its FFN dim), when it has any."""
    out: dict[str, Any] = {"mesh": list(plan.mesh), "params": dict(plan.params), "stages": 1,
                           "placement_groups": plan.placement["groups"] if plan.placement is not None else 1}
    if plan.placement is not None:
        out["placement"] = {"regions": [{k: r[k] for k in ("units", "ranks", "mesh")}
                                        for r in plan.placement["regions"]]}
    if plan.moe:
        out["moe"] = [{**{k: r[k] for k in ("layer", "experts", "axes", "degree", "dispatch")},
                       "ffn_axes": r.get("ffn_axes", [])} for r in plan.moe]  # (none in a plan of before)
    if plan.pipeline is not None:
        v = int(plan.pipeline.get("virtual_stages", 1))
        out["stages"] = len(plan.pipeline["stages"]) // v
        out["pipeline"] = {"schedule": plan.pipeline["schedule"], "microbatches": plan.pipeline["microbatches"],
                           "virtual_stages": v,
                           "stages": [{k: st[k] for k in ("units", "ranks", "mesh")} for st in plan.pipeline["stages"]]}
    return out


# ---- the spawned ranks -------------------------------------------------------------


def _worker(rank: int, world: int, cfg: BenchConfig, plans: dict[str, Plan | str]
            ) -> dict[str, Measurement] | GroupBroken | None:
    """Body of every spawned rank: one thread, every distributed variant timed by the protocol ``cfg.rounds``
    picks (``timing``: 1 ``sequential``, else ``interleaved``); rank 0 returns them, or the ``GroupBroken`` of a
    variant that failed on some ranks while others were left in a collective (then every rank returns, which ends
    its process and frees the stuck ones; ``run_bench`` starts again without that variant)."""
    torch.set_num_threads(1)
    # torch's advice about views; nothing here is in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    ctx = _Context(rank, world, cfg, plans)

    def build(variant: str) -> Step:
        torch.manual_seed(cfg.seed)
        return training_step(_prepared(functools.partial(_DIST_PREPARE[variant], ctx), cfg), cfg.lr)

    try:
        if cfg.rounds == 1:
            out = sequential(cfg.dist_variants, build, cfg.steps, cfg.warmup, world, cfg.agree_grace_s)
        else:
            out = interleaved(cfg.dist_variants, build, cfg.steps, cfg.warmup, cfg.rounds or 0, world,
                              cfg.agree_grace_s)
    except GroupBroken as e:
        return GroupBroken(e.variant, e.reason) if rank == 0 else None  # without its traceback's frames
    return out if rank == 0 else None


def _spawned(cfg: BenchConfig, plans: dict[str, Plan | str]) -> dict[str, Measurement]:
    """Every distributed variant measured by ``_worker`` in one spawned group; after a variant that broke the group
    (``GroupBroken``), in a new group without it (the others measured again from the start), so a failure is that
    variant's reason and never a hang.  ``TimeoutError`` past ``cfg.timeout_s`` in all."""
    from ..runtime.launch import collective_timeout, spawn

    broken: dict[str, Measurement] = {}
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        run = replace(cfg, variants=tuple(v for v in cfg.variants if v not in broken))
        left = deadline - time.monotonic()
        if not run.dist_variants:
            return broken
        if left <= 0:
            raise TimeoutError(f"bench: the spawned ranks did not finish within {cfg.timeout_s:g} s")
        got = spawn(_worker, cfg.devices, run, plans, timeout_s=left,
                    collective_timeout_s=min(left, collective_timeout()))[0]
        if isinstance(got, GroupBroken):
            broken[got.variant] = Measurement(reason=got.reason)
            continue
        return {**got, **broken}


# ---- planning, serial, report --------------------------------------------------------


def make_plans(cfg: BenchConfig, model: nn.Module, inputs: tuple, profile: Any = None) -> dict[str, Plan | str]:
    """soybean's plans (optimal, forced DP, forced MP) from one capture; a failure is its reason.
    ``profile``: a ``Profile`` (or name or path) instead of ``cfg.profile``."""
    from ..api import placed_or_plain
    from ..capture.core import capture
    from ..options import options, plan_kind
    from ..planner.core import plan

    try:
        cap = capture(model, inputs[:-1] if cfg.loss == "outside" else inputs)
    except Exception as e:  # reported for every soybean variant
        return {v: Measurement.failed(e).reason or "capture failed" for v in SOYBEAN_MODES}
    plans: dict[str, Plan | str] = {}
    for variant in SOYBEAN_MODES:
        if variant not in cfg.variants:
            plans[variant] = NOT_SELECTED
            continue
        try:  # what to plan chosen as ``parallelize`` and the CLI choose it (``options.plan_kind``)
            opts = options(None, devices=cfg.devices, objective="time", profile=profile or cfg.profile,
                           **{**cfg.plan_options, **BY_NAME[variant].plan})
            kind = plan_kind(opts)
            if kind == "plain":
                plans[variant] = plan(None, (), options=opts, baselines=False, captured=cap)
            elif kind == "placed":
                plans[variant] = placed_or_plain(cap, cfg.devices, opts.one_program())
            else:
                plans[variant] = _pipelined_plan(cfg, model, inputs, opts)
        except Exception as e:
            plans[variant] = Measurement.failed(e).reason or "planning failed"
    return plans


def _pipelined_plan(cfg: BenchConfig, model: nn.Module, inputs: tuple, opts: PlanOptions) -> Plan:
    """A variant planned with pipeline stages (``opts.pipeline``): ``auto`` (``api.auto_plan``: stages only where
    faster; the plan without them placed where faster with ``placement`` ``auto``) or a number of stages with its
    microbatches and cut searched (``pipeline_plan.search_pipeline``)."""
    from ..api import auto_plan, micro_inputs
    from ..capture.core import capture
    from ..parts.pipeline_plan import search_pipeline

    example = inputs[:-1] if cfg.loss == "outside" else inputs
    stages = opts.pipeline
    if stages == "auto":
        return auto_plan(model, example, {}, opts.one_program(), cfg.devices, "fp32",
                         placement=opts.placement == "auto")
    assert isinstance(stages, int)
    _, _, batch = micro_inputs(example, {}, 1)

    def capture_at(m: int) -> Any:
        return capture(model, micro_inputs(example, {}, m)[0])

    best, searched = search_pipeline(capture_at, batch, cfg.devices, opts.one_program(), stages=stages)
    if best is None:
        raise Unavailable(f"no plan of {stages} pipeline stages: {searched or 'no microbatch count splits the batch'}")
    return best


def _same_plan(a: Plan, b: Plan) -> bool:
    """The same program: mesh, stored tilings and every op's strategy agree.  Full inputs arrive
    whole on every rank, so their planned tiling only says where the (free) slicing happens."""
    def key(p: Plan) -> tuple:
        algorithms = sorted(p.algorithms().items())  # the same tilings, other collective algorithms: not the same
        stages = None if p.pipeline is None else (
            p.pipeline["schedule"], p.pipeline["microbatches"],
            [(st["units"], st["ranks"], st["plan"]["params"], st["plan"]["nodes"]) for st in p.pipeline["stages"]])
        placed = None if p.placement is None else [(r["pieces"], r["ranks"], r["plan"]["params"], r["plan"]["nodes"])
                                                   for r in p.placement["regions"]]
        return (p.mesh, p.params, p.nodes, p.local_batch, p.inputs if p.local_batch else None, algorithms, stages,
                placed)

    return key(a) == key(b)


def candidates(plans: dict[str, Plan | str], predicted: dict[str, float | None], step_s: dict[str, float | None],
               paired_times: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """soybean's candidate plans as distinct programs, and whether the predicted fastest measured fastest.

    A variant whose plan is identical to an earlier one's (the optimum often *is* data parallel)
    is the same program timed twice, so the two share one measurement: the mean of their medians
    (and of their step times, step by step).  Returns the distinct variants, the duplicates
    (``same_plan``: variant -> the one it repeats), the measurement per distinct variant, which one
    is predicted and which measured fastest, and -- when ``paired_times`` holds step times taken in
    turns (step ``i`` of every variant in round ``i``) -- ``significance``:
    :func:`~soybean.bench.stats.fastest_verdict` of the predicted fastest against the others.
    """
    # Each candidate's plan, prediction and median: variants lacking one take no part.
    planned: dict[str, tuple[Plan, float, float]] = {}
    for v in SOYBEAN_MODES:
        p, pred, t = plans.get(v), predicted.get(v), step_s.get(v)
        if isinstance(p, Plan) and pred is not None and t is not None:
            planned[v] = (p, pred, t)
    distinct: list[str] = []
    same: dict[str, str] = {}
    for v, (p, _, _) in planned.items():
        twin = next((d for d in distinct if _same_plan(planned[d][0], p)), None)
        if twin is None:
            distinct.append(v)
        else:
            same[v] = twin
    group = {d: [d] + [v for v, t in same.items() if t == d] for d in distinct}
    measured = {d: statistics.fmean(planned[v][2] for v in vs) for d, vs in group.items()}
    fastest = min(distinct, key=lambda d: planned[d][1]) if distinct else None
    significance = None
    if fastest is not None and paired_times is not None:
        steps = {d: [statistics.fmean(ts) for ts in zip(*(paired_times[v] for v in vs))] for d, vs in group.items()}
        significance = fastest_verdict(fastest, steps)
    return {
        "distinct": distinct, "same_plan": same, "measured_s": measured,
        "predicted_fastest": fastest,
        "measured_fastest": min(distinct, key=lambda d: measured[d]) if distinct else None,
        "significance": significance,
    }


def _prediction_errors(predicted: dict[str, float | None], step_s: dict[str, float | None]) -> dict[str, float]:
    """``predicted / measured - 1`` of soybean's variants that have both (and neither zero)."""
    out = {}
    for v in SOYBEAN_MODES:
        pred, t = predicted[v], step_s[v]
        if pred and t:
            out[v] = pred / t - 1
    return out


def machine_info(serial_threads: int) -> dict[str, Any]:
    """Cores, CPU, load, torch and Python versions: what the timings depend on."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": cores, "cpu_count": os.cpu_count(), "cpu": cpu,
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "serial_threads": serial_threads, "rank_threads": 1, "backend": "gloo",
    }


def _speedup(base: float | None, t: float | None) -> float | None:
    """``base / t``: how many times faster ``t`` is; ``None`` when either is missing."""
    return base / t if base and t else None


def _check_losses(ms: dict[str, Measurement], notes: dict[str, str]) -> None:
    """A variant must reproduce its row's reference first loss (``Variant.loss_reference``): serial's for a full
    batch; for soybean's local contract DDP's (each rank's loss on its own rows: the serial one for a mean,
    1 / ranks of it for a sum).  TP's heuristic plan is nulled, soybean noted."""
    for row in TABLE:
        v, against = row.name, row.loss_reference
        if against is None or v not in ms or against not in ms:
            continue
        ref, m = ms[against].loss, ms[v]
        if ref is None or m.loss is None or math.isclose(m.loss, ref, rel_tol=LOSS_RTOL, abs_tol=1e-6):
            continue
        msg = f"first loss {m.loss:.6g} differs from {against}'s {ref:.6g}"
        if v == "tp":
            ms[v] = Measurement(reason=f"the column/row plan does not compute this model: {msg}", loss=m.loss)
        else:
            notes[v] = msg


# Taking turns keeps every variant's parameters, gradients and AdamW state alive at once.  It
# costs no speed: on the CPU box the wide MLP's sharded plans page-fault the same 98,316 pages per
# step either way (their fresh >= 32 MiB gradients and AdamW temporaries are mapped anew every
# step), and it pairs the variants' steps in time, which a one-after-the-other run cannot.  The
# only limit is memory: turns are taken while the estimate fits in this share of physical memory.
ALTERNATE_MEMORY_SHARE = 0.5


def training_state_bytes(param_bytes: int, variants: Sequence[str], devices: int) -> int:
    """Parameters, gradients and AdamW state of ``variants`` together, over all ranks: a replicating
    variant holds ``PARAM_COPIES`` copies of the model on each of ``devices`` ranks, a sharded one
    that much in all."""
    from ..cost.memory import PARAM_COPIES

    return PARAM_COPIES * param_bytes * sum(devices if v in REPLICATING else 1 for v in variants)


def physical_memory_bytes() -> int | None:
    """This machine's physical memory, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def auto_rounds(state_bytes: int, memory_bytes: int | None = None) -> int:
    """The default protocol: the variants take turns after every step (0) while ``state_bytes``
    (:func:`training_state_bytes`) fits in :data:`ALTERNATE_MEMORY_SHARE` of ``memory_bytes``
    (default: physical memory), else one after the other (1)."""
    memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
    return 0 if memory is None or state_bytes <= ALTERNATE_MEMORY_SHARE * memory else 1


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every variant; returns the report (``step_s``, ``predicted_step_s``, ``plans``, ``machine``, ...).

    Raises ``ValueError`` for a bad config or model reference, and ``RuntimeError`` /
    ``TimeoutError`` when the spawned ranks fail outside a variant.
    """
    cfg.validate()
    prof = None
    if cfg.profile == CALIBRATE:
        from .calibrate import calibrate

        prof, _ = calibrate(cfg.devices, show=False, name="calibrated just before")
    serial_threads = torch.get_num_threads()
    machine = machine_info(serial_threads)
    ms: dict[str, Measurement] = {v: Measurement(reason=NOT_SELECTED) for v in VARIANTS if v not in cfg.variants}
    if SERIAL in cfg.variants:
        torch.manual_seed(cfg.seed)
        ms[SERIAL] = measure(training_step(_prepared(_prepare_serial, cfg), cfg.lr), cfg.steps, cfg.warmup,
                             lambda: None)
        gc.collect()
    model, inputs = _load(cfg)
    plans, layout = make_plans(cfg, model, inputs, prof), tp_layout(model)
    if cfg.rounds is None:
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        cfg = replace(cfg, rounds=auto_rounds(training_state_bytes(param_bytes, cfg.dist_variants, cfg.devices)))
    del model, inputs
    gc.collect()
    if cfg.dist_variants:
        ms.update(_spawned(cfg, plans))
    notes: dict[str, str] = {}
    _check_losses(ms, notes)
    predicted = {v: (p.cost["step_time_s"] if isinstance(p, Plan) else None) for v, p in plans.items()}
    step_s = {v: ms[v].step_s for v in VARIANTS}
    paired = {v: ms[v].times for v in SOYBEAN_MODES if ms[v].times} if cfg.rounds != 1 else None
    cand = candidates(plans, predicted, step_s, paired)
    ranked = cand["distinct"]
    known = {v: t for v, t in predicted.items() if t is not None}  # every candidate's
    rho = spearman([known[v] for v in ranked], [cand["measured_s"][v] for v in ranked])
    return {
        "model": cfg.model, "args": dict(cfg.args), "devices": cfg.devices, "steps": cfg.steps, "warmup": cfg.warmup,
        "loss": cfg.loss,
        "rounds": cfg.rounds,
        "profile": cfg.profile,
        "calibrated_profile": asdict(prof) if prof is not None else None,
        "step_s": step_s,
        "reasons": {v: ms[v].reason for v in VARIANTS if ms[v].step_s is None},
        "speedup_vs_serial": {v: _speedup(step_s[SERIAL], t) for v, t in step_s.items()},
        "speedup_vs_ddp": {v: _speedup(step_s["ddp"], t) for v, t in step_s.items()},
        "predicted_step_s": predicted,
        "spearman": {"rho": rho, "variants": ranked},
        "candidates": cand,
        "step_times_s": {v: ms[v].times for v in VARIANTS if ms[v].times},
        "prediction_error": _prediction_errors(predicted, step_s),
        "plans": {v: plan_summary(p) for v, p in plans.items() if isinstance(p, Plan)},
        "tp_layout": layout,
        "first_loss": {v: ms[v].loss for v in VARIANTS},
        "notes": notes,
        "machine": machine,
    }


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``soybean``'s subparsers; its ``fn`` is :func:`cmd_bench`."""
    return bench_parser(subparsers, cmd_bench)


def cmd_bench(a: argparse.Namespace) -> int:
    """Run the benchmark the parsed arguments describe and print it; the exit code.

    Bad input raises ``ValueError`` (the caller prints it, exit 2); ranks that fail or time out
    outside a variant print one line and give 1.
    """
    styles = LOSS_STYLES if a.loss == "both" else (a.loss,)
    cfgs = [BenchConfig(model=a.model, devices=a.devices, args=models.parse_args(a.arg), steps=a.steps,
                        warmup=a.warmup, profile=a.profile, timeout_s=a.timeout, rounds=a.rounds,
                        variants=tuple(v.strip() for v in a.variants.split(",") if v.strip()), loss=style,
                        plan_options=models.parse_args(a.plan_option))
            for style in styles]
    models.resolve(cfgs[0].model)  # a bad reference fails here, before anything runs
    reports = []
    for cfg in cfgs:
        try:
            reports.append(run_bench(cfg))
        except (RuntimeError, TimeoutError) as e:
            print(f"soybean bench: error: {e}", file=sys.stderr)
            return 1
    if a.json:
        sys.stdout.write(json.dumps(reports[0] if len(reports) == 1 else {"runs": reports}, indent=1) + "\n")
    else:
        sys.stdout.write("\n".join(f"loss {r['loss']} the model:\n{format_table(r)}" if len(reports) > 1
                                   else format_table(r) for r in reports))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench.py``: parse ``argv``, run, print; bad input is one line on stderr and exit 2."""
    ap = argparse.ArgumentParser(prog="bench", description=DESCRIPTION)
    add_arguments(ap)
    a = ap.parse_args(argv)
    try:
        return cmd_bench(a)
    except ValueError as e:
        print(f"soybean bench: error: {e}", file=sys.stderr)
        return 2
