"""Gathers by index tensors: advanced indexing ``x[i0, i1, ...]``, ``gather`` and ``index_select``; and ``scatter``.

The output is made of elements of ``self`` at positions read from integer index tensors.
A dim may be sharded when every device's output tile only needs its own tiles:

* **a dim of self that no index addresses** (``index.Tensor`` with ``None`` or absent
  indices there, ``index_select``/``gather``'s other dims): self, and the output dim it
  becomes, sharded; the index tensors ``R`` (``gather``: sharded alike, and only where
  index and self have the same size, since ``gather`` reads ``self`` at the output's own
  position there);
* **a dim of the index** (the broadcast dims of ``index.Tensor``'s index tensors,
  ``index_select``'s index, ``gather``'s ``dim``): every index that carries it sharded, self
  ``R``; the gathered positions are global values, so each device reads the rows it needs;
* linear in ``self``: self ``P``, indices ``R`` -> out ``P`` (floats).

``scatter`` (``out = self`` with ``out[..., index[..., i_d, ...] at dim, ...] = value`` or ``src``'s element) writes
each element along ``dim`` only, at its own position elsewhere: every other dim where self, index (and ``src``) have
the same size splits, all alike (a router's top-k mask: DeepSeek-V3's group routing).

``index.Tensor``'s output puts the broadcast index shape where the indexed dims were when
they are adjacent, and first otherwise (NumPy's rule).  A boolean mask selects a data-dependent
number of positions (one dim, ``TensorSpec.dynamic``, never split): only the dims no index addresses split.
"""
from __future__ import annotations

import torch

from ..tiling import Placement
from ._common import Args, R, Shard, bcast, partial_strategies
from .base import ELEMENTWISE, OpSpec, Strategy1D, TensorSpec, register


def _broadcast_shape(specs: list[TensorSpec]) -> tuple[int, ...]:
    """The NumPy broadcast of the specs' shapes."""
    nb = max(s.ndim for s in specs)
    return tuple(
        max((s.shape[d - (nb - s.ndim)] for s in specs if d - (nb - s.ndim) >= 0), default=1)
        for d in range(nb)
    )


@register("aten.index.Tensor", family="indexing", cost=ELEMENTWISE)
def index(op: OpSpec) -> list[Strategy1D]:
    """``self[indices]`` with integer index tensors (``None`` entries keep a dim whole)."""
    a = Args(op)
    x = a.tensor("self")
    indices: list = list(a["indices"])
    used = [i for i, t in enumerate(indices) if isinstance(t, TensorSpec)]
    if not used:
        return []
    if any(indices[i].dtype == torch.bool for i in used):
        return _masked(a, x, indices)
    b = _broadcast_shape([indices[i] for i in used])
    rest = [d for d in range(x.ndim) if d not in used]
    if used == list(range(used[0], used[-1] + 1)):  # adjacent: the broadcast block replaces the indexed dims
        start = used[0]
        out_dim = {d: d if d < start else d - len(used) + len(b) for d in rest}
    else:  # apart: the broadcast block comes first
        start = 0
        out_dim = {d: len(b) + k for k, d in enumerate(rest)}
    found = [a.strategy({"self": Shard(d), "indices": [R] * len(indices)}, Shard(out_dim[d])) for d in rest]
    for j in (j for j in range(len(b)) if b[j] > 1):
        pls: list[Placement] = [bcast(t, b, j) if isinstance(t, TensorSpec) else R for t in indices]
        if any(p != R for p in pls):
            found.append(a.strategy({"self": R, "indices": pls}, Shard(start + j)))
    return found + partial_strategies(a, [["self"]])


def addressed(indices: list) -> list[int]:
    """The dims of ``self`` that an index list (``index``/``index_put``'s: ``None``, integer or boolean tensors)
    addresses: an integer index one dim, a boolean mask as many as it has."""
    dims: list[int] = []
    d = 0
    for t in indices:
        k = (t.ndim if t.dtype == torch.bool else 1) if isinstance(t, TensorSpec) else 1
        if isinstance(t, TensorSpec):
            dims.extend(range(d, d + k))
        d += k
    return dims


def _masked(a: Args, x: TensorSpec, indices: list) -> list[Strategy1D]:
    """``self[indices]`` with a boolean mask among the indices: a mask of ``k`` dims addresses ``k`` dims of
    ``self`` and puts one data-dependent dim (its ``True`` count) in their place.  A dim of ``self`` no index
    addresses splits on ``self`` and the output (the masks and other indices ``R``: every rank selects the same
    positions, so the selected count is the same everywhere); the selected dim is never split."""
    covered = addressed(indices)
    rest = [d for d in range(x.ndim) if d not in covered]
    out = a.op.outputs[0]
    block = out.ndim - len(rest)  # the dims the indices' broadcast (a mask: its one selected dim) takes
    if covered == list(range(covered[0], covered[-1] + 1)):  # adjacent: the block replaces the addressed dims
        out_dim = {d: d if d < covered[0] else d - len(covered) + block for d in rest}
    else:  # apart: the block comes first
        out_dim = {d: block + k for k, d in enumerate(rest)}
    found = [a.strategy({"self": Shard(d), "indices": [R] * len(indices)}, Shard(out_dim[d])) for d in rest
             if 0 <= out_dim[d] < out.ndim and out.shape[out_dim[d]] == x.shape[d]]
    return found + partial_strategies(a, [["self"]])


@register("aten.gather.default", family="indexing", cost=ELEMENTWISE)
def gather(op: OpSpec) -> list[Strategy1D]:
    """``out[..., i_d, ...] = self[..., index[..., i_d, ...] if d == dim else i_d, ...]``."""
    a = Args(op)
    x, idx = a.tensor("self"), a.tensor("index")
    dim = a.dim()
    found = [a.strategy({"self": Shard(d), "index": Shard(d)}, Shard(d))
             for d in range(idx.ndim) if d != dim and idx.shape[d] == x.shape[d] > 1]
    if idx.ndim:
        found.append(a.strategy({"self": R, "index": Shard(dim)}, Shard(dim)))
    return found + partial_strategies(a, [["self"]])


@register("aten.one_hot.default", family="indexing", cost=ELEMENTWISE)
def one_hot(op: OpSpec) -> list[Strategy1D]:
    """``out[..., c] = (self[...] == c)``: each index its own row of classes; every dim of ``self`` splits, the new
    last dim (the classes) stays whole."""
    a = Args(op)
    x = a.tensor("self")
    return [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim)]


@register("aten.index_select.default", family="indexing", cost=ELEMENTWISE)
def index_select(op: OpSpec) -> list[Strategy1D]:
    """``dim`` of the output is the 1-D ``index``; every other dim is self's."""
    a = Args(op)
    x = a.tensor("self")
    dim = a.dim()
    found = [a.strategy({"self": Shard(d), "index": R}, Shard(d)) for d in range(x.ndim) if d != dim]
    if x.ndim:
        found.append(a.strategy({"self": R, "index": Shard(0)}, Shard(dim)))
    return found + partial_strategies(a, [["self"]])


@register("aten.scatter.value", "aten.scatter.src", family="indexing", cost=ELEMENTWISE)
def scatter(op: OpSpec) -> list[Strategy1D]:
    """``scatter`` along ``dim``: a dim other than ``dim`` of the same size in self, index and src splits."""
    a = Args(op)
    x, idx = a.tensor("self"), a.tensor("index")
    src = a.spec("src")
    dim = a.dim()
    return [a.strategy({"self": Shard(d), "index": Shard(d), "src": Shard(d)}, Shard(d))
            for d in range(x.ndim) if d != dim and idx.ndim == x.ndim and idx.shape[d] == x.shape[d] > 1
            and (src is None or src.shape[d] == x.shape[d])]
