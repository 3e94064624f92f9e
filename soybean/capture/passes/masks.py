"""What a constant attention mask means, decided without building it (``fold_constant_masks``).

At long context a boolean mask of ``B x 1 x L x S`` is too large to evaluate (128K tokens: 16 GiB a sequence), yet
transformers exports its causal mask that way: a comparison of the keys' positions with the queries', and-ed with
terms that are all true for ordinary inputs (a packed-sequence term comparing document ids, a scalar ``True``).
Such a mask is the broadcast of small tensors, and its meaning follows from them exactly:

* a node small enough (at most ``limit`` elements, its whole cone too) is evaluated;
* a comparison of a query-side operand ``x`` (``(..., L, 1)``) with a key-side one ``y`` (``(..., 1, S)``) is the
  causal mask (``key <= query`` for every pair, ``L == S``) iff, per leading index, ``y`` is non-decreasing and the
  number of keys at or before each query, ``searchsorted(y, x[q])``, is ``q + 1``; ``key < query`` likewise with a
  strict count.  An equality is all true iff ``x`` and ``y`` hold one and the same value;
* ``and`` of meanings: all-true is its identity, causal with causal is causal; a bool-to-bool ``to`` and an
  ``expand`` keep the meaning.

Anything else has no known meaning (``None``): the mask stays.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

ALL, CAUSAL = "all", "causal"
aten = torch.ops.aten

_PASS = {aten.expand.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default,
         aten.clone.default}
_AND = {aten.__and__.Tensor, aten.logical_and.default, aten.bitwise_and.Tensor}
_CMP = {aten.le.Tensor: "le", aten.ge.Tensor: "ge", aten.lt.Tensor: "lt", aten.gt.Tensor: "gt",
        aten.eq.Tensor: "eq"}


def mask_meaning(mask: fx.Node, evaluate: Callable[[fx.Node], Any], limit: int) -> str | None:
    """``ALL``, ``CAUSAL`` or ``None`` for the constant boolean ``mask`` (module docstring); ``evaluate`` computes a
    constant node, called only on nodes whose whole cone has at most ``limit`` elements per node."""
    out = _meaning(mask, evaluate, limit, {})
    if isinstance(out, torch.Tensor) and out.dim() >= 2:  # small enough to judge whole
        return judged(out, *out.shape[-2:])
    return out if isinstance(out, str) else None


def judged(m: torch.Tensor, L: int, S: int) -> str | None:
    """The meaning of the built mask ``m`` over ``L`` queries and ``S`` keys: ``ALL`` when all true, ``CAUSAL`` when
    ``tril`` (``L == S``), else None.  Judged on ``m`` as built, not broadcast: broadcasting repeats it, so it holds
    everywhere iff it holds on ``m``."""
    if m.dtype != torch.bool:
        return None
    if bool(m.all()):
        return ALL
    return CAUSAL if L == S and bool((m == torch.ones(L, S, dtype=torch.bool).tril()).all()) else None


def _numel(n: fx.Node) -> int:
    v = n.meta.get("val")
    return math.prod(v.shape) if isinstance(v, torch.Tensor) else 1


def _small(n: fx.Node, limit: int, seen: dict[fx.Node, bool]) -> bool:
    """Is every node of ``n``'s cone at most ``limit`` elements?"""
    if n not in seen:
        seen[n] = _numel(n) <= limit and all(_small(a, limit, seen) for a in n.all_input_nodes)
    return seen[n]


def _meaning(n: fx.Node, evaluate: Callable[[fx.Node], Any], limit: int, seen: dict[fx.Node, bool]
             ) -> torch.Tensor | str | None:
    if _small(n, limit, seen):
        v = evaluate(n)
        return v if isinstance(v, torch.Tensor) else None
    if n.op != "call_function":
        return None
    if n.target in _PASS:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dtype != torch.bool or not isinstance(n.args[0], fx.Node):
            return None
        inner = _meaning(n.args[0], evaluate, limit, seen)
        return inner if isinstance(inner, str) else None
    if n.target in _AND:
        parts = [_meaning(a, evaluate, limit, seen) if isinstance(a, fx.Node) else None for a in n.args[:2]]
        kinds = [_as_meaning(p) for p in parts]
        if None in kinds:
            return None
        return CAUSAL if CAUSAL in kinds else ALL
    if n.target in _CMP:
        a, b = n.args[:2]
        nodes = [x for x in (a, b) if isinstance(x, fx.Node)]
        if len(nodes) < 2 or not all(_small(x, limit, seen) for x in nodes):
            return None
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            return None
        return _compare(_CMP[n.target], evaluate(nodes[0]), evaluate(nodes[1]), tuple(v.shape))
    return None


def _as_meaning(v: torch.Tensor | str | None) -> str | None:
    """A small operand of ``and`` has a meaning only when all true."""
    if isinstance(v, torch.Tensor):
        return ALL if v.dtype == torch.bool and bool(v.all()) else None
    return v


def _sides(x: torch.Tensor, shape: tuple[int, ...]) -> tuple[str, torch.Tensor] | None:
    """``("q", (N, L))`` for an operand that varies along the queries only, ``("k", (N, S))`` along the keys only
    (``N``: the leading dims broadcast to ``shape``'s), else None."""
    lead, (L, S) = shape[:-2], shape[-2:]
    if x.dim() < 2:
        x = x.reshape((1,) * (2 - x.dim()) + tuple(x.shape))
    if x.shape[-1] == 1 and x.shape[-2] in (L,) and L > 1:
        return "q", x.expand(*lead, L, 1).reshape(-1, L)
    if x.shape[-2] == 1 and x.shape[-1] in (S,) and S > 1:
        return "k", x.expand(*lead, 1, S).reshape(-1, S)
    return None


def _compare(op: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> str | None:
    """The meaning of ``a <op> b`` broadcast to ``shape`` (module docstring)."""
    sa, sb = _sides(a, shape), _sides(b, shape)
    if sa is None or sb is None or sa[0] == sb[0]:
        return None
    x, y = (sa[1], sb[1]) if sa[0] == "q" else (sb[1], sa[1])  # x: queries (N, L), y: keys (N, S)
    if op == "eq":
        same = x.min() == x.max() and y.min() == y.max() and x.min() == y.min()
        return ALL if bool(same) else None
    # ``key <= query`` (inclusive) or ``key < query``, read from the operator and the side ``a`` is on
    relation = {("le", "k"): "<=", ("lt", "k"): "<", ("ge", "q"): "<=", ("gt", "q"): "<"}.get((op, sa[0]))
    if relation is None or shape[-2] != shape[-1]:
        return None
    if not bool((y[:, 1:] >= y[:, :-1]).all()):
        return None
    counts = torch.stack([torch.searchsorted(y[i].contiguous(), x[i].contiguous(), right=relation == "<=")
                          for i in range(y.shape[0])])
    want = torch.arange(1, shape[-2] + 1, device=counts.device).expand_as(counts)
    return CAUSAL if bool((counts == want).all()) else None
