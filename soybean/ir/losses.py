"""A mean loss's denominator, counted from the full target: the one home of that count.

Two places turn a mean loss into a sum over devices divided by a count, and both must count as torch does, or the
loss and every gradient drift from serial: capture rewrites a model's own mean losses into ``sum / count``
(``capture.passes.means_to_sums``, as graph nodes), and a split output's loss computed tile by tile divides each tile's
sum by the count the full target gives (``outputs.LazyFull``, eagerly).  Both read the rules here:

* an elementwise loss (``numel``): the input's element count;
* a class-index loss (``classes``: ``cross_entropy``, ``nll_loss``): ``sum(target != ignore_index)``, or with
  class weights ``w`` the summed weight of the targets not ignored, ``sum(w[target] * (target != ignore_index))``;
  class probabilities as targets: the batch times the positions, ``numel(target) / classes``.
"""
from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100  # torch's default ``ignore_index`` of ``cross_entropy`` and ``nll_loss``


def class_count(target: Any, ignore_index: int = IGNORE_INDEX, ops: Any = torch) -> Any:
    """The denominator of an unweighted class-index loss's mean: the targets not ignored,
    ``sum(target != ignore_index)``, computed by ``ops``: anything with torch's ``ne`` and ``sum`` (default torch
    itself, eagerly; capture passes calls that add the graph's nodes)."""
    return ops.sum(ops.ne(target, ignore_index))


def mean_count(kind: str, numel: int, target: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor | float:
    """The denominator of a ``kind`` loss's mean (module docstring) over an input of ``numel`` elements and the
    full ``target``, with the loss's keywords ``kw`` (``ignore_index``, ``weight``)."""
    if kind == "numel":
        return float(numel)
    if target.is_floating_point():  # class probabilities: a mean over the batch (and positions)
        return float(target.numel() // target.shape[1]) if target.dim() > 1 else float(target.shape[0])
    ignore_index = kw.get("ignore_index", IGNORE_INDEX)
    weight = kw.get("weight")
    if weight is not None:
        keep = target != ignore_index
        return weight[target.clamp(min=0)].masked_fill(~keep, 0).sum()
    return class_count(target, ignore_index)
