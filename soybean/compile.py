"""``torch.compile(model, backend=soybean.compile_backend(...))``: every graph dynamo captures, planned and run
in parallel, inside the user's unchanged training loop.

Dynamo splits the model's forward at graph breaks (data-dependent Python control flow, a ``print``, anything it
cannot trace) and hands each piece to the backend as an FX graph whose parameters are inputs (the user's own
``nn.Parameter`` objects).  For each piece the backend:

1. wraps the graph as a module whose parameters are those very objects and whose inputs are the rest
   (``soybean.run.pieces``: ``PieceBackend``, the machinery ``parallelize`` shares for a model export cannot capture);
   dynamo reuses one graph for every module instance that runs the same code (T5's encoder and decoder share
   ``T5LayerNorm.forward``'s graph, each with its own weight as an input), so a call runs on the parameters it is
   given: other parameter objects get a program of the same plan bound to them, never the first call's;
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

from collections.abc import Callable
from typing import Any

from torch import fx

from .options import PlanOptions, options as merge_options


def compile_backend(options: PlanOptions | None = None, **option_fields: Any
                    ) -> Callable[[fx.GraphModule, list], Callable[..., Any]]:
    """A ``torch.compile`` backend that plans and runs every captured graph on the current process group
    (module docstring).  Call ``torch.compile(model, backend=soybean.compile_backend())`` on every rank, after
    ``torch.distributed.init_process_group`` (or under ``torchrun``).  ``options`` and the keywords
    (``devices=``, ``mesh=``, ``objective=``, ``profile=``, ...) are ``soybean.options.PlanOptions``; the mode is
    ``replicated`` (the user's optimizer holds the parameters).  The backend's ``plans`` lists every piece's
    plan, in the order dynamo captured them."""
    from .api import parallelize
    from .run.pieces import PieceBackend

    opts = merge_options(options, **option_fields)
    if opts.mode not in ("auto", "replicated"):
        raise ValueError(f"compile_backend plans in mode replicated (parameters stored whole, the user's optimizer "
                         f"updates them), not {opts.mode!r}")
    return PieceBackend(opts, parallelize)
