"""``torch.compile(model, backend=soybean.compile_backend(...))``: every graph dynamo captures, planned and run
in parallel, inside the user's unchanged training loop.

Dynamo splits the model's forward at graph breaks (data-dependent Python control flow, a ``print``, anything it
cannot trace) and hands each piece to the backend as an FX graph whose parameters are inputs (the user's own
``nn.Parameter`` objects).  For each piece the backend:

1. wraps the graph as a module whose parameters are those very objects and whose inputs are the rest;
2. plans it with ``soybean.parallelize`` on the current process group (rank 0 plans, every rank runs the same
   plan) in mode ``replicated``: the optimum among plans that **store every parameter whole** on every device,
   while its use may still be split (a column-split matmul reads its slice of the whole weight; the gradient's
   partial sums are all-reduced).  So an optimizer built on ``model.parameters()`` updates exactly what runs:
   after ``backward`` every rank's ``p.grad`` is the full serial gradient, and the step is the serial step on
   every rank;
3. returns the per-rank program, taking and returning full tensors (the full-batch contract: every rank passes
   the whole batch, gets whole outputs), so the Python between pieces runs as it would serially.

Tiled parameter storage (FSDP/ZeRO-style) is not offered here: it would need the user's optimizer to hold the
tiles.  ``parallelize`` plans it.  On a model without graph breaks the backend's plan is ``parallelize``'s with
``mode="replicated"``.  Shapes are taken as static (``torch.compile(..., dynamic=False)``): a new shape is a new
graph, planned anew.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from .options import PlanOptions, options as merge_options


class _Piece(nn.Module):
    """One captured graph as a module: its parameter inputs registered as the user's own objects."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        self.slots: list[str | None] = []  # per graph input: a parameter's name here, or None (a user input)
        for i, x in enumerate(example_inputs):
            if isinstance(x, nn.Parameter):
                self.register_parameter(f"p{i}", x)
                self.slots.append(f"p{i}")
            else:
                self.slots.append(None)

    def forward(self, *inputs: Any) -> Any:
        it = iter(inputs)
        args = [getattr(self, s) if s is not None else next(it) for s in self.slots]
        return self.gm(*args)

    def user_inputs(self, example_inputs: Sequence[Any]) -> tuple:
        return tuple(x for x, s in zip(example_inputs, self.slots) if s is None)


def compile_backend(options: PlanOptions | None = None, **option_fields: Any
                    ) -> Callable[[fx.GraphModule, list], Callable[..., Any]]:
    """A ``torch.compile`` backend that plans and runs every captured graph on the current process group
    (module docstring).  Call ``torch.compile(model, backend=soybean.compile_backend())`` on every rank, after
    ``torch.distributed.init_process_group`` (or under ``torchrun``).  ``options`` and the keywords
    (``devices=``, ``mesh=``, ``objective=``, ``profile=``, ...) are ``soybean.options.PlanOptions``; the mode is
    ``replicated`` (the user's optimizer holds the parameters).  The backend's ``plans`` lists every piece's
    plan, in the order dynamo captured them."""
    from .api import parallelize
    from .plan import Plan

    opts = merge_options(options, **option_fields)
    if opts.mode not in ("auto", "replicated"):
        raise ValueError(f"compile_backend plans in mode replicated (parameters stored whole, the user's optimizer "
                         f"updates them), not {opts.mode!r}")
    opts = opts.merged(mode="replicated")

    plans: list[Plan] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        piece = _Piece(gm, example_inputs)
        users = piece.user_inputs(example_inputs)
        if not any(isinstance(x, torch.Tensor) for x in users):
            return gm.forward  # nothing to split: a piece of parameter-only work runs as is
        pm = parallelize(piece, users, options=opts, outputs="full", share_params=True)
        plans.append(pm.plan)

        def run(*args: Any) -> Any:
            out = pm(*piece.user_inputs(args))
            return out if isinstance(out, (tuple, list)) else (out,)

        return run

    backend.plans = plans  # type: ignore[attr-defined]  # every piece's plan, in the order dynamo captured them
    return backend
