"""Every planning option in one place: its name, default, check and command-line flag.

``PlanOptions`` is what ``soybean.plan``, ``soybean.parallelize``, ``soybean.compile_backend``, the CLI
(``add_plan_options``) and the bench take.  A new option is one field here, one row of ``FLAGS`` and the code
that reads it.  Each entry point also accepts the fields as keywords (``plan(model, x, 8, objective="comm")``);
a keyword given as ``None`` leaves the option as it is (``PlanOptions.merged``).
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
from .search import OBJECTIVES, TARGET_GAP

if TYPE_CHECKING:
    from .cost.profiles import Profile

SOLVERS = ("ilp", "dp")
MODES = ("auto", "dp", "mp", "replicated")
RECOMPUTE = ("none", "layers", "attention", "auto")
COLLECTIVES = ("auto", *ALGORITHMS)
PRECISIONS = tuple(POLICIES)
CP_METHODS = ("auto", "all_gather_kv", "ring")  # ``rules.attention.cp_method``'s names


@dataclass(frozen=True)
class PlanOptions:
    """How to plan (``FLAGS`` gives each field's flag and meaning).  ``devices``: None takes the mesh's size
    (1 without a mesh); ``mesh``: a shape (a ``Mesh``, a tuple or ``"2x4"``), None tries every factorisation;
    ``profile``: None is ``cpu-gloo``; ``precision``: None is fp32 (or a capture's own)."""

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

    @property
    def world(self) -> int:
        """The device count: ``devices``, else the mesh's size, else 1."""
        return self.devices if self.devices is not None else math.prod(self.mesh) if self.mesh else 1

    def merged(self, **changes: Any) -> PlanOptions:
        """These options with every change that is not None (an unknown name is a ``TypeError`` naming it)."""
        unknown = sorted(set(changes) - FIELDS)
        if unknown:
            raise TypeError(f"unknown planning option {', '.join(map(repr, unknown))}: the options are "
                            f"{', '.join(sorted(FIELDS))}")
        given = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self


FIELDS = frozenset(f.name for f in dataclasses.fields(PlanOptions))


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}: use one of {', '.join(choices)}")


def options(base: PlanOptions | None = None, **changes: Any) -> PlanOptions:
    """``base`` (or the defaults) with ``changes`` (``PlanOptions.merged``)."""
    return (base or PlanOptions()).merged(**changes)


# ---- the command line: one flag per option ---------------------------------------------------------------

# (field, flag, argparse keywords).  ``devices`` and ``profile`` get their required-ness and default from the
# command (``add_plan_options``); ``tie_layers`` is the flag's negation.
FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("devices", "--devices", {"type": int, "help": "number of devices P"}),
    ("mesh", "--mesh", {"help": "mesh shape such as 8 or 2x4 (default: try every factorisation into 1-3 axes)"}),
    ("objective", "--objective", {"choices": OBJECTIVES, "default": "time",
                                  "help": "time: the modelled step time (default); comm: bytes moved (SoyBean's)"}),
    ("profile", "--profile", {"help": "cpu-gloo (default), h100-nvlink, h100-nvlink-ib or a JSON file from "
                                      "`soybean calibrate`"}),
    ("solver", "--solver", {"choices": SOLVERS, "default": "ilp"}),
    ("memory_gb", "--memory-gb", {"type": float, "metavar": "GIB",
                                  "help": "per-device memory budget in GiB (2^30 bytes); the modelled peak stays "
                                          "within 95%% of it"}),
    ("recompute", "--recompute", {"choices": RECOMPUTE, "default": "auto",
                                  "help": "auto (default): decide which layers rerun their forward in backward with "
                                          "the tilings, the fastest plan within --memory-gb (none without a budget); "
                                          "or force it: none, every layer (layers), only each layer's attention "
                                          "(attention)"}),
    ("collectives", "--collectives", {"choices": COLLECTIVES, "default": "auto",
                                      "help": "the algorithm each collective runs: auto (default: the cheapest "
                                              "modelled for its group and message), or force the backend's own "
                                              "call or soybean's lp (chain pipelining), ring or tree"}),
    ("expert_imbalance", "--expert-imbalance", {"type": float, "default": 1.0, "metavar": "F",
                                                "help": "mixture of experts: price the busiest rank's routed rows "
                                                        "at F times the balanced share (default 1: balanced "
                                                        "routing); its all-to-alls and expert compute alike"}),
    ("context_parallel", "--context-parallel", {"default": "auto", "metavar": "auto|none|N",
                                                "help": "attention split along the query sequence: auto (default: "
                                                        "the planner chooses), none, or N (every attention op's "
                                                        "query rows split N ways)"}),
    ("context_parallel_method", "--context-parallel-method", {
        "choices": CP_METHODS, "default": "auto",
        "help": "how an attention op split along the sequence gets its keys and values: auto (default: the planner "
                "chooses per op), all_gather_kv (gathered whole by an all-gather) or ring (split too, passed around "
                "the members)"}),
    ("precision", "--precision", {"choices": PRECISIONS, "default": "fp32",
                                  "help": "fp32, or bf16-mixed: bf16 compute from fp32 master weights and AdamW "
                                          "states, gradients reduced in bf16"}),
    ("gpus_per_node", "--gpus-per-node", {"type": int, "metavar": "G",
                                          "help": "devices per node: axes crossing nodes are priced at the "
                                                  "profile's inter-node link"}),
    ("time_limit_s", "--time-limit", {"type": float, "default": 60.0, "metavar": "S",
                                      "help": "seconds per ILP solve; then the best plan found, with its gap "
                                              "(default 60)"}),
    ("gap", "--gap", {"type": float, "metavar": "G",
                      "help": f"stop each solve once its plan is proven within this relative gap (default "
                              f"{TARGET_GAP:g})"}),
    ("jobs", "--jobs", {"type": int, "metavar": "N",
                        "help": "processes that search mesh shapes at once (default: this machine's cores for a "
                                "graph of 400 nodes or more, else 1)"}),
    ("tie_layers", "--no-tie", {"action": "store_false",
                                "help": "solve every layer's choice separately (default: repeated layers share one)"}),
)


def add_plan_options(p: argparse.ArgumentParser, devices_required: bool = False, profile_help: str = "") -> None:
    """Declare every planning flag on ``p`` (``FLAGS``); ``plan_options`` reads them back."""
    for field, flag, kw in FLAGS:
        kw = dict(kw)
        if field == "devices" and devices_required:
            kw["required"] = True
        if field == "profile" and profile_help:
            kw["help"] += profile_help
        p.add_argument(flag, dest=field, **kw)


def plan_options(a: argparse.Namespace) -> PlanOptions:
    """The ``PlanOptions`` of parsed flags (``add_plan_options``); a flag left out keeps the default."""
    return PlanOptions().merged(**{field: getattr(a, field) for field, _, _ in FLAGS})
