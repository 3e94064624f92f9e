"""The ``soybean bench`` command line, apart from the harness: every ``soybean`` command builds its parser, and
the harness imports the runtime and codegen (half a second of a ``soybean plan`` that never benchmarks).  It imports
nothing of the harness: the harness and the command line each give ``add_parser`` the function to run."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .variants import VARIANTS

DESCRIPTION = "Training-step benchmark: serial, DDP, tensor parallel, FSDP2 and soybean's plans, in one run."
# Where the training step computes its loss: in the model (the target among the inputs), or outside it from the
# model's output, ``loss = model.loss_fn(model(*inputs[:-1]), inputs[-1])``, as DDP-style loops do.
LOSS_STYLES = ("inside", "outside")


def add_parser(subparsers: Any, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``soybean``'s subparsers, its ``fn`` ``run`` (``harness.cmd_bench``, or the
    command line's function that imports it when the command runs)."""
    p = subparsers.add_parser("bench", help="time a training step: serial, DDP, TP, FSDP2 and soybean's plans",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(fn=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's arguments on ``p`` (``soybean bench`` and ``scripts/bench.py``)."""
    p.add_argument("model", help="pkg.module:fn or path/file.py:fn; fn(**args) returns (model, example_inputs)")
    p.add_argument("--devices", type=int, required=True, help="number of local gloo processes N")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword for the model factory (repeatable)")
    p.add_argument("--plan-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a PlanOptions field every soybean variant plans with, e.g. expert_imbalance=2 (repeatable)")
    p.add_argument("--steps", type=int, default=12, help="timed steps; the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--profile", default="cpu-gloo",
                   help="soybean's machine profile: cpu-gloo, h100-nvlink, a JSON file, "
                        "or 'calibrate' to measure one just before timing")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the spawned ranks are stopped")
    p.add_argument("--rounds", type=int, default=None,
                   help="0: the variants take turns after every timed step; 1: one after the other; "
                        "N: N turns of steps/N steps "
                        "(default: 0, or 1 when all variants' training state together exceeds half of physical memory)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    p.add_argument("--loss", choices=[*LOSS_STYLES, "both"], default="inside",
                   help="compute the loss in the model (inside), outside it from its output with the model's "
                        "loss_fn as DDP-style loops do (outside), or run both loop styles one after the other")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
