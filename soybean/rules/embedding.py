"""Embedding lookup ``out[idx..., :] = weight[indices[idx...], :]``.

* indices sharded on any dim -> output sharded on the same dim (weight ``R``);
* weight ``S(1)`` (embedding columns) -> output ``S(last)`` (indices ``R``);
* linear in the weight (a gather): weight ``P``, indices ``R`` -> out ``P``.

Vocab-parallel (weight ``S(0)``) needs ids shifted and masked per device,
which plain ``aten.embedding`` does not do (out-of-range ids): not listed.
"""
from __future__ import annotations

from ._common import Args, R, Shard, partial_strategies
from .base import ELEMENTWISE, OpSpec, Strategy1D, register


@register("aten.embedding.default", family="embedding", cost=ELEMENTWISE)
def embedding(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    w, idx = a.spec("weight"), a.spec("indices")
    assert w is not None and idx is not None
    found = [a.strategy({"weight": R, "indices": Shard(d)}, Shard(d)) for d in range(idx.ndim)]
    if w.ndim == 2:
        found.append(a.strategy({"weight": Shard(1), "indices": R}, Shard(idx.ndim)))
    return found + partial_strategies(a, [["weight"]])
