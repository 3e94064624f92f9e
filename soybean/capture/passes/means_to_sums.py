"""``means_to_sums``: ``mean`` and ``mse_loss(mean)`` become ``sum / n`` and ``cross_entropy_loss(reduction='mean')``
becomes ``sum-loss / count``, so that a batch-split loss is a pending sum (``Partial``) instead of forcing a gather of
the logits (the count by ``ir.losses``, the one home of a mean's denominator)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from ...ir.losses import IGNORE_INDEX, class_count
from .common import aten, call


def means_to_sums(gm: fx.GraphModule) -> None:
    """Rewrite means into sums divided by a count (exact in fp32 up to rounding).

    One walk in node order hands each node to the rewrite of its family.  One walk, not one pass
    per family: the new nodes are then created in graph order, and their names (which plans
    record) stay those of a single walk whatever families a model mixes.
    """
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or _data_dependent(n):
            continue
        if n.target in (aten.mean.default, aten.mean.dim):
            _mean_to_sum(g, n)
        elif n.target is aten.mse_loss.default:
            _mse_mean_to_sum(g, n)
        elif n.target is aten.cross_entropy_loss.default:
            _cross_entropy_mean_to_sum(g, n)
    g.lint()


def _data_dependent(n: fx.Node) -> bool:
    """Whether an argument of ``n`` has a size that depends on values: its count is known only at run time, so a
    mean of it stays a mean."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols(a.meta.get("val")) for a in n.all_input_nodes)


def _mean_to_sum(g: fx.Graph, n: fx.Node) -> None:
    """``mean(x, dims)`` of a floating-point ``x`` (no ``dtype``) -> ``sum(x, dims) / count``."""
    x = n.args[0]
    assert isinstance(x, fx.Node)
    shape = tuple(x.meta["val"].shape)
    dims: Any  # a list of ints, as fx recorded it
    keep: Any
    if n.target is aten.mean.default:
        dims, keep = list(range(len(shape))), False
    else:
        dims = n.args[1] if len(n.args) > 1 and n.args[1] is not None else list(range(len(shape)))
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    dtype = n.kwargs.get("dtype")
    if dtype is not None or not x.meta["val"].dtype.is_floating_point:
        return
    count = math.prod(shape[d] for d in dims) if shape else 1
    with g.inserting_before(n):
        s = call(g, aten.sum.dim_IntList, (x, list(dims), keep), like=n)
        d = call(g, aten.div.Tensor, (s, float(count)), like=n)
    n.replace_all_uses_with(d)
    g.erase_node(n)


def _mse_mean_to_sum(g: fx.Graph, n: fx.Node) -> None:
    """``mse_loss(x, y, reduction=mean)`` -> ``mse_loss(x, y, reduction=sum) / numel(x)``."""
    if (n.args[2] if len(n.args) > 2 else n.kwargs.get("reduction", 1)) != 1:
        return
    x, y = n.args[0], n.args[1]
    assert isinstance(x, fx.Node)
    count = math.prod(x.meta["val"].shape)
    with g.inserting_before(n):
        total = call(g, aten.mse_loss.default, (x, y, 2), like=n)
        d = call(g, aten.div.Tensor, (total, float(count)), like=n)
    n.replace_all_uses_with(d)
    g.erase_node(n)


class _GraphCount:
    """``ir.losses.class_count``'s operations as aten nodes added to ``g`` before the node being rewritten
    (with ``like``'s metadata)."""

    def __init__(self, g: fx.Graph, like: fx.Node) -> None:
        self.g, self.like = g, like

    def ne(self, x: fx.Node, value: int) -> fx.Node:
        return call(self.g, aten.ne.Scalar, (x, value), like=self.like)

    def sum(self, x: fx.Node) -> fx.Node:
        return call(self.g, aten.sum.default, (x,), like=self.like)


def _cross_entropy_mean_to_sum(g: fx.Graph, n: fx.Node) -> None:
    """Unweighted, unsmoothed ``cross_entropy_loss(x, labels, reduction=mean)`` ->
    ``cross_entropy_loss(..., reduction=sum) / count of labels != ignore_index``."""
    args = list(n.args) + [None] * (6 - len(n.args))
    x, y, weight, reduction, ignore_index, smoothing = args[:6]
    weight = n.kwargs.get("weight", weight)
    reduction = n.kwargs.get("reduction", 1 if reduction is None else reduction)
    ignore_index = n.kwargs.get("ignore_index", IGNORE_INDEX if ignore_index is None else ignore_index)
    smoothing = n.kwargs.get("label_smoothing", 0.0 if smoothing is None else smoothing)
    if reduction != 1 or weight is not None or smoothing:
        return
    assert isinstance(y, fx.Node)
    if not isinstance(y.meta["val"], torch.Tensor) or y.meta["val"].dtype.is_floating_point:
        return  # probability targets: leave the mean
    with g.inserting_before(n):
        total = call(g, aten.cross_entropy_loss.default, (x, y, None, 2, ignore_index), like=n)
        assert isinstance(ignore_index, int)
        cnt = class_count(y, ignore_index, _GraphCount(g, n))
        d = call(g, aten.div.Tensor, (total, cnt), like=n)
    n.replace_all_uses_with(d)
    g.erase_node(n)
