"""Every planning option in one place: its name, default, check and command-line flag.

``PlanOptions`` is what ``soybean.plan``, ``soybean.parallelize``, ``soybean.compile_backend``, the CLI
(``add_plan_options``) and the bench take.  A new option is one field here, one row of ``FLAGS`` and the code
that reads it; the flag's default is the field's (``add_plan_options`` reads it from here).  Each entry point
also accepts the fields as keywords (``plan(model, x, 8, objective="comm")``); a keyword given as ``None`` leaves
the option as it is (``PlanOptions.merged``).

Which kind of plan the options ask for (one program, placed branches, pipeline stages, or stages searched) is
``plan_kind``'s answer, the one selector ``parallelize``, the CLI and the bench build by, so the three accept the
same combinations.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .ir.algorithms import ALGORITHMS
from .mesh import Mesh
from .precision import POLICIES
from .search import TARGET_GAP

if TYPE_CHECKING:
    from .cost.profiles import Profile
    from .plan import Plan

SOLVERS = ("ilp", "dp")
# What a plan minimises: bytes sent (SoyBean's objective, seconds only breaking ties) or modelled step seconds
# (``planner.problem.to_problem``).
OBJECTIVES = ("comm", "time")
MODES = ("auto", "dp", "mp", "replicated")
RECOMPUTE = ("none", "layers", "attention", "auto")
COLLECTIVES = ("auto", *ALGORITHMS)
PRECISIONS = tuple(POLICIES)
CP_METHODS = ("auto", "all_gather_kv", "ring")  # ``rules.attention.cp_method``'s names
PLACEMENTS = ("none", "auto")
# How a split non-scalar output leaves the program under the full-batch contract: ``lazy``, this rank's tile split
# along dim 0 (or whole), gathered only when the caller reads it whole (``run.outputs.LazyFull``: a loss of
# ``torch.nn.functional`` reduces only the scalar); ``full``, gathered whole in the program.  The planner prices the
# one asked for (``graph.build``'s output), so a loop that computes its loss from the logits outside pays no gather.
OUTPUTS = ("lazy", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")  # ``pipelined.schedule_class``'s names
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")  # schedules that run several stages per rank (``virtual_stages`` > 1)
DEFAULT_VIRTUAL_STAGES = 2  # a ``MULTI_STAGE`` schedule's stages per rank group when ``virtual_stages`` is not given
# What ``plan_kind`` answers: one program over every device; branches on their own device groups where faster
# (``api.placed_or_plain``); ``pipeline`` stages (``pipeline_plan.plan_pipeline``); or the faster of no stages and
# the best pipeline searched (``api.auto_plan``)
PLAN_KINDS = ("plain", "placed", "pipelined", "auto")
# The fields that choose the kind of plan and shape its stages: read by the front ends (``plan_kind``), never by a
# planner of one program (``PlanOptions.one_program``)
KIND_FIELDS = ("pipeline", "microbatches", "schedule", "virtual_stages", "placement")


@dataclass(frozen=True)
class PlanOptions:
    """How to plan (``FLAGS`` gives each field's flag and meaning).  ``devices``: None takes the mesh's size
    (1 without a mesh); ``mesh``: a shape (a ``Mesh``, a tuple or ``"2x4"``), None tries every factorisation;
    ``profile``: None is ``cpu-gloo``; ``precision``: None is fp32 (or a capture's own, or a saved plan's).

    The kind of plan (``plan_kind``): ``pipeline`` None (one program over every device; ``"none"`` reads as None),
    a number of stages of at least 2 (a digit string reads as its number), or ``"auto"`` (stages searched against
    none); ``microbatches``: per step with stages, None is the number of stages; ``schedule``: the pipeline
    schedule (``SCHEDULES``); ``virtual_stages``: stages per rank group, None is ``DEFAULT_VIRTUAL_STAGES`` under
    an interleaved schedule (``MULTI_STAGE``) and 1 under the others (``virtual``); ``placement``: ``"none"`` or
    ``"auto"`` (branches on their own device groups where faster; None reads as ``"none"``).

    ``inflight`` (API only: the pipeline planner sets it for each stage it plans): the microbatches whose
    activations a device holds at once, 1F1B's first stage holding as many as there are stages; every op's
    kept activations are priced that many times (``graph.build``), so the memory budget and the recomputation
    search see the stage's true peak."""

    devices: int | None = None
    mesh: tuple[int, ...] | None = None
    objective: str = "time"
    profile: str | Profile | None = None
    solver: str = "ilp"
    memory_gb: float | None = None
    mode: str = "auto"
    local_batch: bool = False
    time_limit_s: float = 60.0
    gpus_per_node: int | None = None
    tie_layers: bool = True
    gap: float = TARGET_GAP
    precision: str | None = None
    recompute: str = "auto"
    collectives: str = "auto"
    jobs: int | None = None
    expert_imbalance: float = 1.0
    context_parallel: str | int = "auto"
    context_parallel_method: str = "auto"
    pipeline: int | str | None = None
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int | None = None
    placement: str = "none"
    outputs: str = "lazy"
    inflight: int = 1

    def __post_init__(self) -> None:
        mesh = self.mesh
        if mesh is not None:
            shape = Mesh.parse(mesh).shape if isinstance(mesh, str) else tuple(getattr(mesh, "shape", mesh))
            object.__setattr__(self, "mesh", tuple(int(s) for s in shape))
        _choice("objective", self.objective, OBJECTIVES)
        _choice("solver", self.solver, SOLVERS)
        _choice("mode", self.mode, MODES)
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("collectives", self.collectives, COLLECTIVES)
        _choice("context_parallel_method", self.context_parallel_method, CP_METHODS)
        _choice("outputs", self.outputs, OUTPUTS)
        if self.precision is not None:
            _choice("precision", self.precision, PRECISIONS)
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {self.devices}")
        if self.mesh is not None and self.devices is not None and math.prod(self.mesh) != self.devices:
            raise ValueError(f"mesh {Mesh(self.mesh)} (--mesh) has {math.prod(self.mesh)} devices, not {self.devices} "
                             f"(--devices): give a mesh whose sizes multiply to {self.devices}")
        cp = self.context_parallel
        if isinstance(cp, str) and cp.isdigit():
            object.__setattr__(self, "context_parallel", cp := int(cp))
        if cp not in ("auto", "none") and not (isinstance(cp, int) and cp >= 2):
            raise ValueError(f"--context-parallel {cp!r}: use auto (the planner chooses), none, or a number N >= 2 "
                             "(every attention op's query sequence split N ways)")
        if self.expert_imbalance < 1:
            raise ValueError("--expert-imbalance is the busiest rank's routed rows over the balanced share: at least "
                             f"1, got {self.expert_imbalance:g}")
        if not 0 <= self.gap < 1:
            raise ValueError(f"--gap must be in [0, 1), got {self.gap:g}")
        if self.time_limit_s <= 0:
            raise ValueError(f"--time-limit must be positive, got {self.time_limit_s:g}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"--memory-gb must be positive GiB, got {self.memory_gb:g}")
        if self.inflight < 1:
            raise ValueError(f"inflight is the microbatches whose activations are held at once: at least 1, got "
                             f"{self.inflight}")
        self._check_kind()

    def _check_kind(self) -> None:
        """Read ``pipeline`` and ``placement`` as their one spelling each, and refuse what no plan can be."""
        if self.placement is None:  # ``parallelize(placement=None)``, its documented "every op on every device"
            object.__setattr__(self, "placement", "none")
        _choice("placement", self.placement, PLACEMENTS)
        pipe = self.pipeline
        if isinstance(pipe, str) and pipe.isdigit():
            object.__setattr__(self, "pipeline", pipe := int(pipe))
        elif pipe == "none":
            object.__setattr__(self, "pipeline", pipe := None)
        if not (pipe is None or pipe == "auto" or (isinstance(pipe, int) and not isinstance(pipe, bool)
                                                   and pipe >= 2)):
            raise ValueError(f"--pipeline {pipe!r}: use none, auto or a number of stages of at least 2")
        if isinstance(pipe, int) and self.placement == "auto":
            raise ValueError(f"--placement auto with --pipeline {pipe}: a fixed number of stages is planned stage by "
                             "stage, without placement; give --pipeline auto (the faster of the stages searched and "
                             "the plan without stages, placed where faster) or drop one of them")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"--microbatches must be >= 1, got {self.microbatches}")
        _choice("schedule", self.schedule, SCHEDULES)
        if self.schedule == "1f1b" and isinstance(pipe, int) and self.microbatches is not None \
                and self.microbatches < pipe:  # torch's ``Schedule1F1B`` refuses it at the first step
            raise ValueError(f"--schedule 1f1b with --pipeline {pipe} and --microbatches {self.microbatches}: 1F1B "
                             f"needs at least as many microbatches as stages; use --microbatches {pipe} or more, or "
                             "--schedule gpipe")
        v = self.virtual_stages
        if v is not None and (v < 1 or (v > 1) != (self.schedule in MULTI_STAGE)):
            raise ValueError(f"--schedule {self.schedule} with --virtual-stages {v}: {', '.join(MULTI_STAGE)} run 2 "
                             "or more stages per rank group (default 2), the others 1")

    @property
    def world(self) -> int:
        """The device count: ``devices``, else the mesh's size, else 1."""
        return self.devices if self.devices is not None else math.prod(self.mesh) if self.mesh else 1

    @property
    def virtual(self) -> int:
        """The stages per rank group: ``virtual_stages``, else ``DEFAULT_VIRTUAL_STAGES`` under an interleaved
        schedule and 1 under the others."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return DEFAULT_VIRTUAL_STAGES if self.schedule in MULTI_STAGE else 1

    def microbatches_for(self, stages: int) -> int:
        """The microbatches per step of a pipeline of ``stages`` stages: ``microbatches``, else ``stages``."""
        return self.microbatches if self.microbatches is not None else stages

    def one_program(self) -> PlanOptions:
        """These options with the kind fields (``KIND_FIELDS``) at their defaults: what a planner of one program
        (``planner.plan``, each stage's or region's) is given, after the front end has chosen the kind."""
        return dataclasses.replace(self, **{k: _DEFAULTS[k] for k in KIND_FIELDS})

    def merged(self, **changes: Any) -> PlanOptions:
        """These options with every change that is not None (an unknown name is a ``TypeError`` naming it)."""
        unknown = sorted(set(changes) - FIELDS)
        if unknown:
            raise TypeError(f"unknown planning option {', '.join(map(repr, unknown))}: the options are "
                            f"{', '.join(sorted(FIELDS))}")
        given = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self


FIELDS = frozenset(f.name for f in dataclasses.fields(PlanOptions))
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(PlanOptions)}


def default(field: str) -> Any:
    """``PlanOptions``' default of ``field`` (its one written default: the CLI's flags read it here)."""
    return _DEFAULTS[field]


def plan_kind(opts: PlanOptions, saved: Plan | None = None) -> str:
    """Which kind of plan (``PLAN_KINDS``) to build from ``opts``, or to run ``saved`` (a plan given, not made)
    as: the one selector of ``parallelize``, the CLI and the bench.

    ``pipeline`` "auto" is ``auto`` (with ``placement`` "auto", the plan without stages may place branches); a
    number of stages ``pipelined``; else ``placement`` "auto" is ``placed`` and nothing ``plain``.  A saved plan
    runs as what it holds (stages, placed regions, or neither); ``pipeline`` a number with a saved plan that has
    no stages is an error."""
    if saved is not None:
        if saved.pipeline is not None:
            return "pipelined"
        if isinstance(opts.pipeline, int):
            raise ValueError(f"pipeline={opts.pipeline} was given with a plan that has no pipeline stages: plan with "
                             "pipeline= too, or drop it")
        return "placed" if saved.placement is not None else "plain"
    if opts.pipeline == "auto":
        return "auto"
    if opts.pipeline is not None:
        return "pipelined"
    return "placed" if opts.placement == "auto" else "plain"


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}: use one of {', '.join(choices)}")


def options(base: PlanOptions | None = None, **changes: Any) -> PlanOptions:
    """``base`` (or the defaults) with ``changes`` (``PlanOptions.merged``)."""
    return (base or PlanOptions()).merged(**changes)


# ---- the command line: one flag per option ---------------------------------------------------------------

def _pipeline_flag(value: str) -> int | str | None:
    """``--pipeline``'s value as ``PlanOptions`` reads it, refused when parsed (argparse's usage line with it)."""
    try:
        return PlanOptions(pipeline=value).pipeline
    except ValueError as e:  # argparse names the flag: the check's own words after it
        raise argparse.ArgumentTypeError(f"{value!r}: {str(e).split(': ', 1)[-1]}") from None


# (field, flag, argparse keywords).  No row gives a default: ``add_plan_options`` takes each from ``PlanOptions``
# (help shows it as ``%(default)s``).  ``devices`` and ``profile`` get their required-ness and help from the command
# (``add_plan_options``); ``tie_layers`` is the flag's negation.
FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("devices", "--devices", {"type": int, "help": "number of devices P"}),
    ("mesh", "--mesh", {"help": "mesh shape such as 8 or 2x4 (default: try every factorisation into 1-3 axes)"}),
    ("objective", "--objective", {"choices": OBJECTIVES,
                                  "help": "time: the modelled step time; comm: bytes moved (SoyBean's) "
                                          "(default %(default)s)"}),
    ("profile", "--profile", {"help": "cpu-gloo (default), h100-nvlink, h100-nvlink-ib or a JSON file from "
                                      "`soybean calibrate`"}),
    ("solver", "--solver", {"choices": SOLVERS, "help": "(default %(default)s)"}),
    ("memory_gb", "--memory-gb", {"type": float, "metavar": "GIB",
                                  "help": "per-device memory budget in GiB (2^30 bytes); the modelled peak stays "
                                          "within 95%% of it"}),
    ("recompute", "--recompute", {"choices": RECOMPUTE,
                                  "help": "auto: decide which layers rerun their forward in backward with the "
                                          "tilings, the fastest plan within --memory-gb (none without a budget); "
                                          "or force it: none, every layer (layers), only each layer's attention "
                                          "(attention) (default %(default)s)"}),
    ("collectives", "--collectives", {"choices": COLLECTIVES,
                                      "help": "the algorithm each collective runs: auto (the cheapest modelled for "
                                              "its group and message), or force the backend's own call or "
                                              "soybean's lp (chain pipelining), ring or tree (default %(default)s)"}),
    ("expert_imbalance", "--expert-imbalance", {"type": float, "metavar": "F",
                                                "help": "mixture of experts: price the busiest rank's routed rows "
                                                        "at F times the balanced share (default %(default)g; 1 is "
                                                        "balanced routing); its all-to-alls and expert compute "
                                                        "alike"}),
    ("outputs", "--outputs", {"choices": OUTPUTS,
                              "help": "a split non-scalar output (logits) under the full-batch contract: lazy, this "
                                      "rank's batch rows, gathered only where the loop reads it whole (a loss of "
                                      "torch.nn.functional needs no gather); full, gathered in the program; the "
                                      "plan prices the one given (default %(default)s)"}),
    ("context_parallel", "--context-parallel", {"metavar": "auto|none|N",
                                                "help": "attention split along the query sequence: auto (the "
                                                        "planner chooses), none, or N (every attention op's query "
                                                        "rows split N ways) (default %(default)s)"}),
    ("context_parallel_method", "--context-parallel-method", {
        "choices": CP_METHODS,
        "help": "how an attention op split along the sequence gets its keys and values: auto (the planner chooses "
                "per op), all_gather_kv (gathered whole by an all-gather) or ring (split too, passed around the "
                "members) (default %(default)s)"}),
    ("precision", "--precision", {"choices": PRECISIONS,
                                  "help": "fp32 (default), or bf16-mixed: bf16 compute from fp32 master weights and "
                                          "AdamW states, gradients reduced in bf16"}),
    ("gpus_per_node", "--gpus-per-node", {"type": int, "metavar": "G",
                                          "help": "devices per node: axes crossing nodes are priced at the "
                                                  "profile's inter-node link"}),
    ("time_limit_s", "--time-limit", {"type": float, "metavar": "S",
                                      "help": "seconds per ILP solve; then the best plan found, with its gap "
                                              "(default %(default)g)"}),
    ("gap", "--gap", {"type": float, "metavar": "G",
                      "help": "stop each solve once its plan is proven within this relative gap (default "
                              "%(default)g)"}),
    ("jobs", "--jobs", {"type": int, "metavar": "N",
                        "help": "processes that search mesh shapes at once (default: this machine's cores for a "
                                "graph of 400 nodes or more, else 1)"}),
    ("tie_layers", "--no-tie", {"action": "store_false",
                                "help": "solve every layer's choice separately (default: repeated layers share one)"}),
    ("placement", "--placement", {"choices": PLACEMENTS,
                                  "help": "independent branches (towers, Inception blocks) on their own device "
                                          "groups, each group tiling its branches (DLPlacer): auto (where modelled "
                                          "faster; with --pipeline auto, the plan without stages) or none (every op "
                                          "on every device) (default %(default)s)"}),
    ("pipeline", "--pipeline", {"type": _pipeline_flag, "metavar": "none|auto|S",
                                "help": "pipeline stages: none (default: one SPMD program over every device), a "
                                        "number S (the layers cut evenly into S stages, S x V with --virtual-stages "
                                        "V, each planned on devices/S devices) or auto (stage counts, microbatches "
                                        "and cuts searched against no stages)"}),
    ("microbatches", "--microbatches", {"type": int, "metavar": "M",
                                        "help": "microbatches per step with --pipeline (default: the number of "
                                                "stages)"}),
    ("schedule", "--schedule", {"choices": SCHEDULES,
                                "help": "the pipeline schedule (torch.distributed.pipelining's) with --pipeline "
                                        "(default %(default)s)"}),
    ("virtual_stages", "--virtual-stages", {"type": int, "metavar": "V",
                                            "help": f"stages per rank group: 2 or more with --schedule "
                                                    f"{' or '.join(MULTI_STAGE)} (default {DEFAULT_VIRTUAL_STAGES}), "
                                                    "1 with the others"}),
)


def add_plan_options(p: argparse.ArgumentParser, devices_required: bool = False, profile_help: str = "") -> None:
    """Declare every planning flag on ``p`` (``FLAGS``), each defaulting to its ``PlanOptions`` field's default;
    ``plan_options`` reads them back."""
    for field, flag, kw in FLAGS:
        kw = {**kw, "default": _DEFAULTS[field]}
        if field == "devices" and devices_required:
            kw["required"] = True
        if field == "profile" and profile_help:
            kw["help"] += profile_help
        p.add_argument(flag, dest=field, **kw)


def plan_options(a: argparse.Namespace) -> PlanOptions:
    """The ``PlanOptions`` of parsed flags (``add_plan_options``); a flag left out keeps the default."""
    return PlanOptions().merged(**{field: getattr(a, field) for field, _, _ in FLAGS})
