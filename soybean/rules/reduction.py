"""Reductions and scans along dims.

``out = reduce_{d in D} x``.  A dim outside ``D`` may be sharded (the output
keeps it, possibly renumbered when ``keepdim=False``).  A dim inside ``D``:

* ``sum``: local sums add up -> output ``P`` (floats only);
* ``mean``: local means of ``n/p`` elements sum to ``p`` times the mean (and
  uneven chunks weigh differently), so not listed; ``max``/``amax``/``var``...:
  not sums, not listed (``P`` means pending *sum*); nor ``linalg_vector_norm`` (a root of a sum) and
  ``logsumexp`` (a log of one).

``sum`` and ``mean`` are linear: ``P`` -> ``P``.  Scans (``cumsum``) and their
inverse ``diff`` (``x[i+1] - x[i]`` along ``dim``, after ``prepend``/``append``,
which have the input's shape but along ``dim``) keep every dim but the scanned
one; both are linear (``diff`` jointly in the input, ``prepend`` and ``append``).  ``topk`` and ``sort`` along a
dim keep every other dim (a router's top-k experts per token).
"""
from __future__ import annotations

from ._common import Args, P, Shard, dims_arg, outputs_float, partial_strategies
from .base import ELEMENTWISE, OpSpec, Strategy1D, is_float, register

# op -> (name of its dim argument or None for "all dims", sum-like over a split dim, linear)
TABLE: dict[str, tuple[str | None, bool, bool]] = {
    "aten.sum.default": (None, True, True),
    "aten.sum.dim_IntList": ("dim", True, True),
    "aten.mean.default": (None, False, True),
    "aten.mean.dim": ("dim", False, True),
    "aten.amax.default": ("dim", False, False),
    # the largest and least element of the whole tensor: not a sum of the tiles' (I-BERT's ``x.data.min()``)
    "aten.max.default": (None, False, False),
    "aten.min.default": (None, False, False),
    "aten.amin.default": ("dim", False, False),
    "aten.max.dim": ("dim", False, False),
    "aten.min.dim": ("dim", False, False),
    "aten.argmax.default": ("dim", False, False),
    "aten.argmin.default": ("dim", False, False),
    "aten.var.correction": ("dim", False, False),
    "aten.var.dim": ("dim", False, False),
    "aten.std.correction": ("dim", False, False),
    "aten.std.dim": ("dim", False, False),
    "aten.linalg_vector_norm.default": ("dim", False, False),
    "aten.logsumexp.default": ("dim", False, False),
    # boolean reductions (LED's ``is_global_attn = is_index_global_attn.flatten().any()``): not sums
    "aten.any.default": (None, False, False),
    "aten.any.dim": ("dim", False, False),
    "aten.any.dims": ("dim", False, False),
    "aten.all.default": (None, False, False),
    "aten.all.dim": ("dim", False, False),
}


def reduce_rule(op: OpSpec) -> list[Strategy1D]:
    dim_arg, sum_like, linear = TABLE[op.name]
    a = Args(op)
    x = a.tensor("self")
    red = set(dims_arg(a[dim_arg] if dim_arg else None, x.ndim))
    keep = bool(a["keepdim"])
    can_p = is_float(x) and outputs_float(op)
    found: list[Strategy1D] = []
    for d in range(x.ndim):
        if d not in red:
            od = d if keep else d - sum(r < d for r in red)
            found.append(a.strategy({"self": Shard(d)}, Shard(od)))
        elif sum_like and can_p:
            found.append(a.strategy({"self": Shard(d)}, P))
    if linear and can_p:
        found.append(a.strategy({"self": P}, P))
    return found


register(*TABLE, family="reduction", cost=ELEMENTWISE)(reduce_rule)


@register("aten.cumsum.default", family="reduction", cost=ELEMENTWISE)
def cumsum(op: OpSpec) -> list[Strategy1D]:
    """Prefix sum along ``dim``: other dims split freely; linear."""
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d != dim]
    return found + partial_strategies(a, [["self"]])


@register("aten.diff.default", family="reduction", cost=ELEMENTWISE)
def diff(op: OpSpec) -> list[Strategy1D]:
    """``n``-th forward difference along ``dim``: other dims split on input, prepend, append alike."""
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    found = [
        a.strategy({"self": Shard(d), "prepend": Shard(d), "append": Shard(d)}, Shard(d))
        for d in range(x.ndim)
        if d != dim
    ]
    return found + partial_strategies(a, [["self", "prepend", "append"]])


@register("aten.topk.default", "aten.sort.default", "aten.sort.stable", family="reduction", cost=ELEMENTWISE)
def along_dim(op: OpSpec) -> list[Strategy1D]:
    """``topk`` and ``sort`` along ``dim`` (values and indices): every other dim splits, both outputs alike (the
    indices are positions along the whole ``dim``, which stays whole)."""
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    return [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d != dim]
