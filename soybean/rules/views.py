"""Views and data movement: reshape family, permutes, squeeze/unsqueeze, expand,
slicing/selection, and cat/stack/split.

All of these only move elements, so they are linear (``P`` -> ``P``, floats
only) and a sharded dim survives if it maps to one output dim:

* **reshape** (``view``, ``reshape``, ``_unsafe_view``, ``flatten``,
  ``unflatten``, ``view_as``): the shapes split into groups of dims with equal
  products.  A 1-to-1 group maps its dim freely.  In a merged/split group only
  the *outermost* (first non-1) input dim may be sharded, onto the outermost
  output dim, and both must split *evenly* (``Strategy1D.even``): then device
  ``k`` holds the contiguous range ``[k N/p, (k+1) N/p)`` of the flattened group
  on both sides.  Size arguments are rewritten to the local output shape
  (``localize``), which also removes ``-1``.
* **permute/transpose/t/numpy_T/unsqueeze/squeeze**: dims are renumbered.  A squeezed
  dim is never sharded (a local tile of size 1 would be squeezed where the
  global dim is not); bare ``squeeze()`` therefore gets ``P`` only.
* **expand**, ``broadcast_to``: an existing full-size dim follows the input; a broadcast or new
  dim is sharded on the output only (input ``R``, local expand size).
* **slice/narrow/select**: any dim but the indexed one; so for their inverses ``slice_scatter`` and
  ``select_scatter`` (what in-place updates of slices become), linear in the base and the source.
* **cat/stack/split/chunk/tensor_split/unbind**: any dim but the joined/split one.

**Layouts on tiles** (``may_copy``): whether a ``view`` is possible depends on its input's strides, and a rank's
tile need not have the serial value's layout: a reshard collective returns a contiguous tile, and the runtime's
attention calls (query rows, ring, zig-zag) return theirs in their own layout, where the serial op's output may
be permuted (CPU attention returns ``(B, T, H, D)`` storage for a ``(B, H, T, D)`` result, so nanoGPT's
``y.transpose(1, 2).contiguous().view(B, T, C)`` is captured without its ``contiguous``).  A view that merges dims
the serial layout kept adjacent then fails on the tile.  ``may_copy`` marks, from the captured graph alone, every
reshape-family op that may have to copy on a tile; the generated program runs those views as ``reshape`` (a view
where the tile allows one, else a copy of the tile: torch decides from the strides the tile has), and the cost
model prices them as that copy (``cost.compute.copy_seconds``).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from ._common import Args, P, Shard, bcast, norm_dim, outputs_float, partial_strategies, size_localizer
from .base import ELEMENTWISE, VIEW, OpSpec, Strategy1D, lookup, op_name, register


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, bool]]:
    """``(src dim, dst dim, merged)`` per group of dims with equal products (size-1 dims skipped).

    ``merged`` is False for a 1-to-1 group (same size on both sides).
    """
    if math.prod(src) != math.prod(dst) or math.prod(src) == 0:
        return []
    si = [i for i, n in enumerate(src) if n != 1]
    di = [j for j, n in enumerate(dst) if n != 1]
    out: list[tuple[int, int, bool]] = []
    i = j = 0
    while i < len(si) and j < len(di):
        first_i, first_j = si[i], di[j]
        ps, pd = src[si[i]], dst[di[j]]
        gi = gj = 1
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                ps, gi, i = ps * src[si[i]], gi + 1, i + 1
            else:
                pd, gj, j = pd * dst[di[j]], gj + 1, j + 1
        out.append((first_i, first_j, gi > 1 or gj > 1))
    return out


def reshape_strategies(a: Args, src: str = "self", shape_like: str | None = None) -> list[Strategy1D]:
    """Strategies of a reshape of tensor argument ``src`` into the op's output shape.

    ``shape_like`` names a tensor argument whose shape is the output shape
    (``view_as``): it is placed like the output.
    """
    op = a.op
    x = a.spec(src)
    assert x is not None
    out = op.outputs[0].shape
    found: list[Strategy1D] = []
    for d, o, merged in view_groups(x.shape, out):
        even = [(a.idx(src), d), (a.out_idx(), o)] if merged else []
        roles = {src: Shard(d)}
        if shape_like:
            roles[shape_like] = Shard(o)
        found.append(a.strategy(roles, Shard(o), even))
    if a.all_float(src) and outputs_float(op):
        found.append(a.strategy({src: P}, P))
    return found


def _reshape(op: OpSpec) -> list[Strategy1D]:
    return reshape_strategies(Args(op))


register(
    "aten.view.default", "aten._unsafe_view.default", localize=size_localizer("size"), family="views", cost=VIEW
)(_reshape)
register("aten.reshape.default", localize=size_localizer("shape"), family="views", cost=VIEW)(_reshape)
register("aten.flatten.using_ints", family="views", cost=VIEW)(_reshape)


def _unflatten_sizes(op: OpSpec, local_out: Sequence[int]) -> list[int]:
    a = Args(op)
    x = a.tensor("self")
    d = norm_dim(a["dim"], x.ndim)
    return list(local_out[d: d + len(a["sizes"])])


register("aten.unflatten.int", localize=size_localizer("sizes", _unflatten_sizes), family="views", cost=VIEW)(_reshape)


@register("aten.view_as.default", "aten.reshape_as.default", family="views", cost=VIEW)
def view_as(op: OpSpec) -> list[Strategy1D]:
    """Reshape to ``other``'s shape: ``other`` (values unused) is placed like the output."""
    return reshape_strategies(Args(op), shape_like="other")


def renumber(a: Args, perm: Sequence[int | None]) -> list[Strategy1D]:
    """Input dim ``d`` becomes output dim ``perm[d]`` (``None``: not shardable); linear."""
    found = [a.strategy({"self": Shard(d)}, Shard(o)) for d, o in enumerate(perm) if o is not None]
    return found + partial_strategies(a, [["self"]])


def _ndim(a: Args) -> int:
    x = a.tensor("self")
    return x.ndim


@register("aten.permute.default", family="views", cost=VIEW)
def permute(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    n = _ndim(a)
    dims = [norm_dim(d, n) for d in a["dims"]]
    return renumber(a, [dims.index(d) for d in range(n)])


@register("aten.flip.default", family="views", cost=ELEMENTWISE)
def flip(op: OpSpec) -> list[Strategy1D]:
    """``flip(x, dims)``: a copy with ``dims`` reversed; a dim it does not reverse splits (each tile is flipped
    where it lies), a reversed one stays whole (device k's rows would be device p-1-k's); linear."""
    a = Args(op)
    x = a.tensor("self")
    flipped = {d % x.ndim for d in a["dims"]}
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d not in flipped]
    return found + partial_strategies(a, [["self"]])


@register("aten.as_strided.default", family="views", cost=VIEW)
def as_strided(op: OpSpec) -> list[Strategy1D]:
    """``as_strided(x, size, stride, offset)`` reads any elements of ``x``'s storage in any order (LED's sliding
    chunks): nothing splits; it runs on the whole tensor."""
    return []


@register("aten.transpose.int", family="views", cost=VIEW)
def transpose(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    n = _ndim(a)
    d0, d1 = norm_dim(a["dim0"], max(n, 1)), norm_dim(a["dim1"], max(n, 1))
    swap = {d0: d1, d1: d0}
    return renumber(a, [swap.get(d, d) for d in range(n)])


@register("aten.numpy_T.default", family="views", cost=VIEW)
def numpy_t(op: OpSpec) -> list[Strategy1D]:
    """``x.T``: every dim reversed."""
    a = Args(op)
    n = _ndim(a)
    return renumber(a, [n - 1 - d for d in range(n)])


@register("aten.t.default", family="views", cost=VIEW)
def t(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    n = _ndim(a)
    return renumber(a, [1, 0] if n == 2 else list(range(n)))


@register("aten.unsqueeze.default", family="views", cost=VIEW)
def unsqueeze(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    n = _ndim(a)
    dim = norm_dim(a["dim"], n + 1)
    return renumber(a, [d if d < dim else d + 1 for d in range(n)])


@register("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", family="views", cost=VIEW)
def squeeze(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    named = a["dim"] if op.name != "aten.squeeze.default" else list(range(x.ndim))
    named = {norm_dim(d, max(x.ndim, 1)) for d in ([named] if isinstance(named, int) else named)}
    removed = {d for d in named if d < x.ndim and x.shape[d] == 1}
    perm: list[int | None] = []
    for d in range(x.ndim):
        perm.append(None if d in named else d - sum(r < d for r in removed))
    return renumber(a, perm)


@register("aten.expand.default", localize=size_localizer("size"), family="views", cost=VIEW)
@register("aten.broadcast_to.default", localize=size_localizer("size"), family="views", cost=VIEW)
def expand(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    out = op.outputs[0].shape
    found = [a.strategy({"self": bcast(x, out, o)}, Shard(o)) for o in range(len(out))]
    return found + partial_strategies(a, [["self"]])


@register("aten.expand_as.default", family="views", cost=VIEW)
def expand_as(op: OpSpec) -> list[Strategy1D]:
    """Expand to ``other``'s shape: ``other`` (values unused) is placed like the output."""
    a = Args(op)
    x = a.tensor("self")
    out = op.outputs[0].shape
    found = [a.strategy({"self": bcast(x, out, o), "other": Shard(o)}, Shard(o)) for o in range(len(out))]
    return found + partial_strategies(a, [["self"]])


@register("aten.slice.Tensor", family="views", cost=VIEW)
def slice_(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    whole = a["start"] in (None, 0) and (a["end"] is None or a["end"] >= x.shape[dim]) and a["step"] == 1
    return renumber(a, [d if (d != dim or whole) else None for d in range(x.ndim)])


@register("aten.slice_scatter.default", family="views", cost=ELEMENTWISE)
def slice_scatter(op: OpSpec) -> list[Strategy1D]:
    """``self`` with ``self[..., start:end:step, ...] = src`` along ``dim``: any other dim split on ``self``,
    ``src`` (same rank) and the output alike; jointly linear in ``self`` and ``src``."""
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    found = [a.strategy({"self": Shard(d), "src": Shard(d)}, Shard(d)) for d in range(x.ndim) if d != dim]
    return found + partial_strategies(a, [["self", "src"]])


@register("aten.select_scatter.default", family="views", cost=ELEMENTWISE)
def select_scatter(op: OpSpec) -> list[Strategy1D]:
    """``self`` with ``self.select(dim, index) = src`` (``src`` lacks ``dim``): any other dim split on all three
    (renumbered on ``src``); jointly linear in ``self`` and ``src``."""
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    found = [a.strategy({"self": Shard(d), "src": Shard(d - (d > dim))}, Shard(d)) for d in range(x.ndim) if d != dim]
    return found + partial_strategies(a, [["self", "src"]])


@register("aten.select.int", "aten.unbind.int", family="views", cost=VIEW)
def select(op: OpSpec) -> list[Strategy1D]:
    """``dim`` disappears (one index, or one output per index): every other dim may be sharded."""
    a = Args(op)
    n = _ndim(a)
    dim = norm_dim(a["dim"], n)
    return renumber(a, [None if d == dim else d - (d > dim) for d in range(n)])


@register(
    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.narrow.default",
    "aten.tensor_split.indices", "aten.tensor_split.sections",
    family="views", cost=VIEW,
)
def split(op: OpSpec) -> list[Strategy1D]:
    """Outputs are pieces along ``dim`` (``narrow``: one piece; ``tensor_split``: cut at indices, or into sections,
    as transformers 5.25's Qwen 3.5 splits its projections): any other dim is sharded on every piece."""
    a = Args(op)
    n = _ndim(a)
    dim = norm_dim(a["dim"], n)
    return renumber(a, [d if d != dim else None for d in range(n)])


def _joined(a: Args) -> tuple[int, int] | None:
    """``(ndim, dim)`` of cat/stack inputs, or ``None`` for mixed ranks (legacy empty tensors)."""
    specs = a["tensors"]
    ranks = {s.ndim for s in specs}
    if len(ranks) != 1:
        return None
    (n,) = ranks
    return n, a["dim"]


@register("aten.cat.default", "aten.concatenate.default", "aten.concat.default", family="views", cost=ELEMENTWISE)
def cat(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    j = _joined(a)
    if j is None:
        return []
    n, dim = j[0], norm_dim(j[1], j[0])
    found = [a.strategy({"tensors": Shard(d)}, Shard(d)) for d in range(n) if d != dim]
    return found + partial_strategies(a, [["tensors"]])


@register("aten.stack.default", family="views", cost=ELEMENTWISE)
def stack(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    j = _joined(a)
    if j is None:
        return []
    n, dim = j[0], norm_dim(j[1], j[0] + 1)
    found = [a.strategy({"tensors": Shard(d)}, Shard(d if d < dim else d + 1)) for d in range(n)]
    return found + partial_strategies(a, [["tensors"]])



# ---- layouts on tiles -----------------------------------------------------------------------------------------------

# Ops that only re-describe their input's elements in the same order (or add or drop dims of size 1): a contiguous
# input gives a contiguous output, so they never change whether a later view is possible on a contiguous tile.
RESHAPES = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.flatten.using_ints",
    "aten.unflatten.int", "aten.view_as.default", "aten.reshape_as.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.alias.default", "aten.detach.default",
})
# A view that needs its input's layout: run on a tile as the reshape of the same meaning (``as_reshape``).
_AS_RESHAPE = {
    "aten.view.default": torch.ops.aten.reshape.default,
    "aten._unsafe_view.default": torch.ops.aten.reshape.default,
    "aten.view_as.default": torch.ops.aten.reshape_as.default,
}
# Reshapes that copy when the layout asks for it (in the serial run too: their traced value has its own storage).
_COPYING = frozenset({"aten.reshape.default", "aten.flatten.using_ints", "aten.reshape_as.default"})
# Rule families whose kernels write a fresh tensor in a layout of their own choosing, whatever their inputs' strides
# (products, softmax, lookups, losses, factories, attention, routed experts): a layout does not pass through them.
# Every other op (elementwise ops follow their inputs' strides; norms, convolutions and pools keep a memory format;
# an op without a rule is not known) is taken to pass its inputs' layouts on.
FRESH = frozenset({"matmul", "softmax", "embedding", "loss", "factory", "attention", "experts"})
# Families the program may run by a runtime call of its own (``sb_sdpa_rows``, ``sb_routed_experts``), whose output
# layout need not be the serial op's.
RUNTIME_LAYOUT = frozenset({"attention", "experts"})
MAY_COPY = "soybean_may_copy"  # node.meta key: ``may_copy``'s answer, set for every op of a graph (False: no reshape)


def as_reshape(target: Any) -> Any:
    """The reshape that means what view ``target`` means, copying where the input's layout allows no view (``None``
    for an op that is not such a view)."""
    return _AS_RESHAPE.get(op_name(target))


def may_copy(node: fx.Node) -> bool:
    """Whether reshape-family op ``node`` of a captured graph may have to copy its input on some rank's tile: the
    generated program runs it as a reshape (``as_reshape``) and the cost model prices the copy.

    A value's tile is laid out as the serial value, or contiguous (what a reshard collective returns), except
    after an op the program may run by a runtime call (attention, routed experts).  Where a value's layout may so
    *diverge* from the serial one (its serial value is not contiguous, or it comes from such a call) and a
    *layout-changing* view (a permutation, a slice, an expand: any view not in ``RESHAPES``) follows before the
    reshape, with only ops that pass a layout on between them (``FRESH``), the reshape's input may be laid out
    on the tile so that no view exists although the serial one did.  A reshape reading such a call's output
    directly is marked too.  A reshape whose serial run copies (its traced value has its own storage) copies on
    the tiles as well.  One forward pass over the graph computes the answer of every op (``MAY_COPY``; False for one
    that is no reshape), so asking of any op walks a graph once: a captured graph does not change.
    """
    if MAY_COPY not in node.meta:
        _mark_layouts(node.graph)
    return bool(node.meta.get(MAY_COPY, False))


def _family(node: fx.Node) -> str | None:
    entry = lookup(node.target)
    return entry.family if entry is not None else None


def _contiguous(val: Any) -> bool:
    """Whether every tensor of a traced value is contiguous (a value that is no tensor has no layout)."""
    vals = val if isinstance(val, (list, tuple)) else [val]
    return all(not isinstance(v, torch.Tensor) or v.is_contiguous() for v in vals)


def _shares_storage(a: Any, b: Any) -> bool:
    try:
        return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)
    except Exception:  # a value without storage (a subclass, a non-tensor): say it may copy
        return False


def _layout_changing(node: fx.Node) -> bool:
    """A view that changes which elements are adjacent (permutes, slices, expands); an op without a rule may."""
    entry = lookup(node.target)
    if entry is None:
        return True
    return entry.cost is not None and entry.cost.view and op_name(node.target) not in RESHAPES


def _mark_layouts(graph: fx.Graph) -> None:
    """``may_copy`` for every op of ``graph`` (False for all but the reshape family), by one pass in topological
    order that keeps, per value, ``diverged``: its tile's layout may differ from the serial one, and ``broken``: a
    layout-changing view ran after such a divergence, so the tile may not be viewable where the serial value is."""
    diverged: dict[fx.Node, bool] = {}
    broken: dict[fx.Node, bool] = {}
    for n in graph.nodes:
        val = n.meta.get("val")
        ins = [a for a in n.all_input_nodes if a in diverged]
        fam = _family(n) if n.op == "call_function" and n.target is not operator.getitem else None
        fresh = n.op != "call_function" or fam in FRESH or (
            n.target is torch.ops.aten.clone.default and n.kwargs.get("memory_format") == torch.contiguous_format)
        own = not _contiguous(val) or fam in RUNTIME_LAYOUT
        if fresh:
            diverged[n], broken[n] = own, False
        else:
            changing = n.target is not operator.getitem and _layout_changing(n)
            diverged[n] = own or any(diverged[a] for a in ins)
            broken[n] = any(broken[a] for a in ins) or (changing and any(diverged[a] for a in ins))
        if n.op == "call_function" and op_name(n.target) in RESHAPES:
            x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            src = x.args[0] if x is not None and x.target is operator.getitem else x  # a multi-output op's value
            copies = x is not None and (broken.get(x, False) or (
                isinstance(src, fx.Node) and src.op == "call_function" and _family(src) in RUNTIME_LAYOUT))
            if x is not None and op_name(n.target) in _COPYING and isinstance(val, torch.Tensor):
                copies = copies or not _shares_storage(val, x.meta.get("val"))
            n.meta[MAY_COPY] = copies
        elif n.op == "call_function":
            n.meta[MAY_COPY] = False
