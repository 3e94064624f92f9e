"""Whether a model computes the same on microbatches as on the whole batch: the condition pipeline stages rely on.

A pipelined step runs the model on ``m`` microbatches (every batch-major input cut into ``m`` equal slices of rows
along dim 0, ``api.micro_inputs``) and the loss on each.  That is the serial step only when the model's rows are
independent,

    f(x)  =  concat_i f(x_i)        (x_i the i-th slice of rows, every batch-major output compared along dim 0),

which almost every model satisfies and some do not: transformers' Doge views its router logits ``[B, S, 2K]`` as
``[2, B S, K]`` (each half of the memory of the whole batch, not of each sequence, becomes one set of scores), a
mixture of experts with a capacity drops tokens by how many share its batch (Switch Transformers), batch norm in
training normalises by the batch's statistics.  Training such a model in microbatches trains another model, with no
error anywhere, so ``parallelize`` checks the equation on the example before it plans stages (``difference``) and
refuses with ``MicrobatchError`` where it does not hold (``check``).

The check runs the model eagerly, without grad, in evaluation mode (dropout draws differently for a slice than for
the whole batch, so training mode would differ on every model that has it), with its buffers and the random state
restored afterwards (``capture.eager.untouched``); batch norm's training-mode coupling, which evaluation mode hides,
is found by its modules instead (``_batch_norms``).  A model whose parameters are on the meta device cannot run: it
is not checked.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..capture.eager import untouched

# The relative difference (Frobenius norms) above which an output is taken to differ: far above the round-off of a
# matmul whose rows are blocked differently (about 1e-7 of the norm in float32), far below what a coupled model
# gives (Doge's router: 0.1 and more); in half precision a multiple of its epsilon.
RTOL = 1e-4
EPS_MULTIPLE = 8


class MicrobatchError(ValueError):
    """The model's output on the whole batch is not its outputs on the microbatches stacked: pipeline stages with
    more than one microbatch would train a different model."""


class MicrobatchWarning(UserWarning):
    """``pipeline="auto"`` searched no stages: the model does not compute the same on microbatches."""


def _rows(x: Any, batch: int, rows: int, i: int) -> Any:
    return x[i * rows:(i + 1) * rows] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x


@contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.train(mode)


def _batch_norms(model: torch.nn.Module) -> list[str]:
    """Batch norm modules in training mode: each normalises by the statistics of the batch it is given."""
    return [f"{name or 'the model'} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]


def _tolerance(t: torch.Tensor) -> float:
    return max(RTOL, EPS_MULTIPLE * torch.finfo(t.dtype).eps) if t.is_floating_point() else 0.0


def difference(model: torch.nn.Module, args: tuple, kwargs: dict, microbatches: int) -> str | None:
    """Why ``model`` on the example's ``microbatches`` slices of rows does not give its output on the whole batch
    (the first output that differs, and by how much; or the batch norms that couple rows), None when it does or
    cannot be run (the meta device, an example that does not run eagerly)."""
    if microbatches <= 1:
        return None
    if norms := _batch_norms(model):
        return (f"batch norm in training mode normalises each microbatch by its own statistics "
                f"({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''})")
    if any(t.is_meta for t in model.parameters()):
        return None
    batch = next((int(x.shape[0]) for x in [*args, *kwargs.values()] if isinstance(x, torch.Tensor) and x.dim()),
                 None)
    if batch is None or batch % microbatches:
        return None  # the pipeline's own check says so (``pipelined.check_microbatches``)
    rows = batch // microbatches
    try:
        with untouched(model), _evaluating(model), torch.no_grad():
            whole = tree_leaves(model(*args, **kwargs))
            parts = [tree_leaves(model(*(_rows(a, batch, rows, i) for a in args),
                                       **{k: _rows(v, batch, rows, i) for k, v in kwargs.items()}))
                     for i in range(microbatches)]
    except Exception:  # the example does not run eagerly here: nothing is known
        return None
    for j, w in enumerate(whole):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or not w.dim() or w.shape[0] != batch:
            continue
        pieces = [p[j] for p in parts if j < len(p)]
        if len(pieces) != microbatches or any(not isinstance(p, torch.Tensor) or p.shape[1:] != w.shape[1:]
                                             or p.shape[0] != rows for p in pieces):
            continue
        stacked = torch.cat(pieces).to(torch.float64)
        ref = w.to(torch.float64)
        rel = float((stacked - ref).norm() / ref.norm().clamp_min(1e-30))
        if not rel <= _tolerance(w):  # (a NaN differs too)
            return (f"its output {j} (shape {tuple(w.shape)}) on the batch of {batch} differs from its outputs on "
                    f"{microbatches} microbatches of {rows} stacked by {rel:.3g} of its norm")
    return None


def check(why: str | None, model: str, microbatches: int) -> None:
    """``MicrobatchError`` naming ``why`` (``difference``'s answer) and the fixes, when there is one."""
    if why is None:
        return
    raise MicrobatchError(
        f"{model} does not compute the same on microbatches as on the whole batch: {why}. Some op mixes the rows "
        f"of the batch, so pipeline stages with {microbatches} microbatches would train another model than the "
        f"serial one. Fix: microbatches=1 with schedule='gpipe' (--microbatches 1 --schedule gpipe: the stages "
        f"run the whole batch in turn), or no pipeline "
        f"(the plan without stages splits the batch exactly: the rows it mixes are exchanged)")
