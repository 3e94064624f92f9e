"""Ops whose output size depends on values, and the sizes planning prices them at.

``nonzero``, a boolean mask (``x[mask]``: ``index.Tensor``), ``masked_select``, ``unique`` and a tensor read as a
Python number (``item``, ``tolist()``: ``_local_scalar_dense``; the sizes ``split`` then takes) make sizes that
``torch.export`` cannot know: unbacked ``SymInt`` s (``u0``) in ``meta["val"]``.  Planning reads each such size as
one number, ``base.priced`` (the example run's value, which ``record_sizes`` gives every symbol at capture), and
marks the dim data-dependent (``TensorSpec.dynamic``): no strategy splits it (``base.splits_dynamic``), so every
collective on such a tensor moves a dim of fixed size, and the generated program runs the op on its run-time sizes.

The rules: an op that reads values to make a size runs on the whole values (its input ``R``), so every rank computes
the same sizes:

* ``item``/``_local_scalar_dense`` (a number from a one-element tensor), ``nonzero``/``argwhere`` (the positions),
  ``masked_select`` (the selected elements, row-major), ``unique`` (``_unique2``, ``unique_dim``,
  ``unique_consecutive``), ``repeat_interleave.Tensor``, ``bincount``: replicated only (no split is listed);
* ``sym_size.int`` (a dim's size read as a number): its input in any placement that keeps that dim whole;
* ``index_put`` (``x[i] = v``, ``x[mask] = v``; ``accumulate``: ``+=``): a dim of ``self`` no index addresses splits
  on ``self``, the output and the dim of ``values`` it broadcasts to; with ``accumulate``, ``self`` and ``values``
  ``P`` make a ``P`` (the update is a sum);
* ``index_add`` (``out = self``, ``out[index[i]] += alpha * source[i]`` along ``dim``): any other dim where ``self``
  and ``source`` agree splits on both; ``self`` and ``source`` ``P`` -> ``P``; and ``index``, ``source``'s ``dim``
  split with ``self`` ``P`` -> ``P`` (each rank adds its rows' contributions).

``index.Tensor`` with boolean masks is in ``rules/indexing.py`` (the dims no mask covers split).
"""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten, tree_map

from ._common import Args, P, R, Shard, free_placements, partial_strategies
from .base import (
    DYNAMIC,
    ELEMENTWISE,
    OpCost,
    OpSpec,
    Strategy1D,
    dynamic_dims,
    norm_dim,
    op_name,
    priced,
    priced_shape,
    recorded_hints,
    register,
    symbol_hint,
)
from .indexing import addressed

NUMBER = OpCost(flops=lambda op: 1.0)  # reads one element


# ---- the sizes an example run had -----------------------------------------------------------------------------


def unbacked_symbols(graph: fx.Graph) -> set[Any]:
    """The unbacked symbols (data-dependent sizes and numbers) the values of ``graph`` mention."""
    out: set[Any] = set()
    for n in graph.nodes:
        out |= free_unbacked_symbols(n.meta.get("val"))
    return out


def _symbol(expr: Any) -> bool:
    """Whether a ``SymInt``'s expression is one symbol (``u0``), not a sum or product of them."""
    return bool(getattr(expr, "is_Symbol", False))


def _shape_env(graph: fx.Graph) -> Any:
    for n in graph.nodes:
        for x in tree_flatten(n.meta.get("val"))[0]:
            for d in x.shape if isinstance(x, torch.Tensor) else (x,):
                if isinstance(d, torch.SymInt):
                    return d.node.shape_env
    return None


def record_sizes(gm: fx.GraphModule, feed: list[Any]) -> dict[str, int]:
    """Run ``gm`` once on ``feed`` (its placeholders' real values) and give every unbacked symbol of its values the
    value it took (``ShapeEnv.var_to_hint_override``: the optimisation hint ``base.priced`` reads, which never
    guards).  Returns them by name (``{"u0": 3}``).  Nothing runs when the graph has no such symbol.

    The run changes nothing it is given: buffers a forward updates in place are fed as copies by the caller, the
    random number generators are restored, and no gradient is recorded.  A run that fails (a model on the meta
    device) records no values: then every size is priced at its upper bound (at least 1 when it has none)."""
    wanted = unbacked_symbols(gm.graph)
    env = _shape_env(gm.graph)
    if not wanted or env is None:
        return {}
    seen: dict[Any, int] = {}

    def bind(fake: Any, real: Any) -> None:
        if isinstance(fake, torch.SymInt) and _symbol(fake.node.expr) and \
                fake.node.expr in wanted and isinstance(real, (int, bool, torch.SymInt)):
            seen.setdefault(fake.node.expr, int(real))
        elif isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor) and fake.dim() == real.dim():
            for f, r in zip(fake.shape, real.shape):
                bind(f, r)

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            fakes, reals = tree_flatten(n.meta.get("val"))[0], tree_flatten(out)[0]
            if len(fakes) == len(reals):
                for f, r in zip(fakes, reals):
                    bind(f, r)
            return out

    with _quiet_run():
        try:
            Recorder(gm).run(*feed)
        except Exception:  # any failure means: no example values, price at the bounds
            seen.clear()
    for s in wanted - set(seen):  # not met in the run: its upper bound, or its lower one (at least 1) if none
        rng = env.var_to_range.get(s)
        upper, lower = _finite(getattr(rng, "upper", None)), _finite(getattr(rng, "lower", None))
        seen[s] = upper if upper is not None else max(lower or 1, 1)
    recorded_hints(env).update(seen)
    return {str(s): v for s, v in sorted(seen.items(), key=lambda kv: str(kv[0]))}


def _finite(bound: Any) -> int | None:
    """A range bound as an ``int``; ``None`` when it is infinite (or absent)."""
    if isinstance(bound, int) or getattr(bound, "is_Integer", False):
        return int(bound)
    return None


@contextlib.contextmanager
def _quiet_run() -> Iterator[None]:
    """No gradient recorded, the random number generators as they were before."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        yield


def concretize(gm: fx.GraphModule) -> dict[str, int]:
    """Make every size of ``gm``'s values concrete, once, after ``record_sizes``: each ``meta["val"]`` becomes a
    meta tensor of its ``priced`` sizes and strides (tensors that shared a storage share one still: the memory
    model tells views by it), its data-dependent dims kept as its ``base.DYNAMIC`` mark (``TensorSpec.dynamic``);
    a number becomes its priced value (a condition on sizes, ``None``).  Every op that makes a new
    data-dependent size records it, by symbol, in ``node.meta[SIZES]`` (``PlanGraph.data_dependent``, the
    planner's warning).  So nothing after capture meets an unbacked ``SymInt``, whose ``int()``, comparison or
    contiguity raises.  Returns every symbol's priced value by name; nothing changes in a graph without one."""
    if not unbacked_symbols(gm.graph):
        return {}
    extent: dict[int, int] = {}  # fake storage -> the bytes its views reach, at priced sizes
    for n in gm.graph.nodes:
        for t in tree_flatten(n.meta.get("val"))[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                extent[key] = max(extent.get(key, 0), _reach(t))
    storages = {k: torch.empty(b, dtype=torch.uint8, device="meta").untyped_storage() for k, b in extent.items()}
    known: set[Any] = set()
    sizes: dict[str, int] = {}
    vals = {n: n.meta.get("val") for n in gm.graph.nodes}  # as traced: concretizing a node changes its readers' view
    for n in gm.graph.nodes:
        val = vals[n]
        mentions = free_unbacked_symbols(val)
        made = mentions - known
        known |= mentions
        found = {str(s): _priced_symbol(s, val) for s in sorted(mentions, key=str)}
        sizes.update(found)
        # An op makes sizes from values when it makes a new symbol, or when its output's size is data-dependent
        # and no input's is (``nonzero`` of a mask whose count torch already knew).
        if n.op == "call_function" and n.target is not operator.getitem and mentions and (
                made or not any(free_unbacked_symbols(vals.get(a)) for a in n.all_input_nodes)):
            n.meta[SIZES] = found
        n.meta["val"] = tree_map(lambda x: _concrete(x, storages), val)
    return dict(sorted(sizes.items()))


SIZES = "soybean_sizes"  # node.meta: the data-dependent sizes an op makes, by symbol, at their priced values


def _reach(t: torch.Tensor) -> int:
    """Bytes of storage ``t`` reaches, at priced sizes: offset plus its last element's position."""
    shape, stride = priced_shape(t.shape), priced_shape(t.stride())
    if any(d == 0 for d in shape):
        return 0
    return (priced(t.storage_offset()) + sum((d - 1) * s for d, s in zip(shape, stride)) + 1) * t.element_size()


def _priced_symbol(s: Any, val: Any) -> int:
    """The priced value of symbol ``s`` that ``val`` mentions (through one of its ``SymInt`` s' environment)."""
    for x in tree_flatten(val)[0]:
        for d in x.shape if isinstance(x, torch.Tensor) else (x,):
            if isinstance(d, torch.SymInt) and s in d.node.expr.free_symbols:
                return symbol_hint(s, d.node.shape_env)
    return 0


def _concrete(x: Any, storages: dict[int, Any]) -> Any:
    if isinstance(x, torch.Tensor):
        dynamic = dynamic_dims(x.shape)
        t = torch.empty(0, dtype=x.dtype, device="meta").set_(
            storages[x.untyped_storage()._cdata], priced(x.storage_offset()), priced_shape(x.shape),
            priced_shape(x.stride()))
        if x.requires_grad:
            t.requires_grad_(True)
        if dynamic:
            setattr(t, DYNAMIC, dynamic)
        return t
    if isinstance(x, torch.SymInt):
        return priced(x)
    if isinstance(x, (torch.SymBool, torch.SymFloat)):
        return None
    return x


def data_dependent(graph: fx.Graph) -> dict[str, dict[str, int]]:
    """The ops of a captured graph that make data-dependent sizes (``concretize``'s marks), by op name, with
    the sizes they make at their priced values."""
    out: dict[str, dict[str, int]] = {}
    for n in graph.nodes:
        if SIZES in n.meta:
            out.setdefault(op_name(n.target), {}).update(n.meta[SIZES])
    return dict(sorted(out.items()))


def data_dependent_warning(ops: dict[str, dict[str, int]], shown: int = 8) -> str:
    """The planner's one warning naming the ops that make data-dependent sizes (``data_dependent``)."""
    sizes = {k: v for found in ops.values() for k, v in found.items()}
    listed = ", ".join(f"{k}={v}" for k, v in list(sizes.items())[:shown])
    more = f", ... ({len(sizes)} in all)" if len(sizes) > shown else ""
    return (f"soybean: sizes that depend on values (made by {', '.join(ops)}) are planned at the example's "
            f"({listed}{more}); those dims are never split, and the program runs on each step's own sizes")


# ---- rules ------------------------------------------------------------------------------------------------------


@register("aten.item.default", "aten._local_scalar_dense.default", family="datadep", cost=NUMBER)
def item(op: OpSpec) -> list[Strategy1D]:
    """A number read from a one-element tensor: every rank reads the whole (replicated) value."""
    return []


@register("aten._assert_async.default", "aten._assert_async.msg", family="datadep", cost=NUMBER)
def assert_async(op: OpSpec) -> list[Strategy1D]:
    """A model's assertion on a value (dynamo's ``assert cond``, I-BERT's range check): every rank checks the whole
    (replicated) condition, so every rank fails alike."""
    return []


@register("aten.nonzero.default", "aten.argwhere.default", "aten.masked_select.default", "aten._unique2.default",
          "aten.unique_dim.default", "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor",
          "aten.bincount.default", family="datadep", cost=ELEMENTWISE)
def replicated(op: OpSpec) -> list[Strategy1D]:
    """Values in, a data-dependent number of them out (positions, selected elements, distinct values, counts):
    computed whole on every rank, so every rank has the same sizes."""
    return []


@register("aten.sym_size.int", family="datadep", cost=OpCost(flops=lambda op: 0.0))  # reads metadata only
def sym_size(op: OpSpec) -> list[Strategy1D]:
    """``x.size(dim)``: only the size of ``dim`` is read, so ``x`` may be placed any way that keeps ``dim`` whole."""
    a = Args(op)
    x = a.tensor("self")
    dim = norm_dim(a["dim"], max(x.ndim, 1))
    return [Strategy1D((p,), ()) for p in free_placements(x) if p != R and p != Shard(dim)]


@register("aten.index_put.default", family="datadep", cost=ELEMENTWISE)
def index_put(op: OpSpec) -> list[Strategy1D]:
    """``out = self`` with ``out[indices] = values`` (``+=`` with ``accumulate``).  A dim of ``self`` no index
    addresses is whole in every indexed position, so it splits on ``self``, ``out`` and the trailing dim of
    ``values`` it lines up with (``values`` broadcasts to ``self[indices]``, whose last dims are those of ``self``
    after the indexed block when the indices are leading and adjacent)."""
    a = Args(op)
    x, v = a.tensor("self"), a.tensor("values")
    indices: list = list(a["indices"])
    used = addressed(indices)
    found: list[Strategy1D] = []
    if used == list(range(len(used))):  # leading, adjacent: ``self[indices]`` = (*b, *rest)
        for d in range(len(used), x.ndim):
            j = v.ndim - (x.ndim - d)  # values' dim lined up with self's dim d (from the right)
            vp = (Shard(j) if v.shape[j] == x.shape[d] else R) if j >= 0 else R
            if vp == R and j >= 0 and v.shape[j] != 1:
                continue
            found.append(a.strategy({"self": Shard(d), "indices": [R] * len(indices), "values": vp}, Shard(d)))
    if a["accumulate"]:
        found += partial_strategies(a, [["self", "values"]])
    return found


@register("aten.index_add.default", family="datadep", cost=ELEMENTWISE)
def index_add(op: OpSpec) -> list[Strategy1D]:
    """``out = self``, ``out[..., index[i], ...] += alpha * source[..., i, ...]`` along ``dim``: the rows along any
    other dim are independent (split where ``self`` and ``source`` agree); linear in (``self``, ``source``)
    together; and a sum over ``source``'s rows, so ``index`` and ``source`` split along ``dim`` with ``self`` ``P``
    (only the first rank's summand holds it) make each rank's summand of ``out``."""
    a = Args(op)
    x, src = a.tensor("self"), a.tensor("source")
    dim = a.dim()
    found = [a.strategy({"self": Shard(d), "source": Shard(d)}, Shard(d))
             for d in range(x.ndim) if d != dim and src.ndim == x.ndim and src.shape[d] == x.shape[d]]
    if a.all_float("self", "source") and src.ndim:
        found.append(a.strategy({"self": P, "index": Shard(0), "source": Shard(norm_dim(dim, src.ndim))}, P))
    return found + partial_strategies(a, [["self", "source"]])


__all__ = ["record_sizes", "concretize", "data_dependent", "data_dependent_warning", "unbacked_symbols", "SIZES"]
