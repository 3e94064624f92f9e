"""Contractions: mm, bmm, matmul, addmm, baddbmm, linear — by einsum reasoning.

Each op is an einsum ``out[F] = sum_C prod_i x_i[I_i]`` (plus an optional
broadcast ``bias`` added to the output, scaled by ``beta``).  On one mesh axis:

* a *free* index ``f`` (in the output) may be sharded on every operand that
  carries it and on the output; an operand that broadcasts it (size 1 or
  missing), and the bias if it does not carry it, stays ``R``;
* a *contracted* index ``c`` sharded on every operand that carries it gives a
  partial sum: output ``P``, and the bias ``P`` (only one device may add it;
  the runtime zeroes it elsewhere);
* the op is linear in each operand: one operand ``P``, the others ``R``,
  bias ``P`` -> output ``P``.

DTensor's ``mm`` is ``"mk,kn->mn"``; ``linear`` is ``"...k,nk->...n"`` plus bias ``n``; ``einsum`` reads
its own equation (``einsum_subscripts``).
"""
from __future__ import annotations

import math
import string
from collections.abc import Sequence

from ..tiling import Placement
from ._common import Args, P, R, Shard, outputs_float
from .base import OpCost, OpSpec, Strategy1D, TensorSpec, is_float, register


def einsum_strategies(
    a: Args, operands: Sequence[tuple[str, str]], out: str, bias: str | None = None
) -> list[Strategy1D]:
    """One-axis strategies of ``out = einsum(operands) (+ bias)``.

    ``operands`` pairs an argument name with its subscripts (one letter per
    dim); the bias (argument named by ``bias``) broadcasts against ``out``.
    """
    op = a.op
    out_shape = op.outputs[0].shape
    size: dict[str, int] = dict(zip(out, out_shape))
    specs: dict[str, TensorSpec] = {}
    for name, sub in operands:
        spec = a.spec(name)
        assert spec is not None and spec.ndim == len(sub), (op.name, name, sub)
        specs[name] = spec
        for letter, n in zip(sub, spec.shape):
            size[letter] = max(size.get(letter, 1), n)
    bias_spec = a.spec(bias) if bias else None
    bias_sub = out[len(out) - bias_spec.ndim:] if bias_spec is not None and bias_spec.ndim else ""
    can_p = outputs_float(op)

    def place(spec: TensorSpec, sub: str, letter: str) -> Placement:
        if letter in sub and spec.shape[sub.index(letter)] == size[letter]:
            return Shard(sub.index(letter))
        return R

    found: list[Strategy1D] = []
    letters = list(dict.fromkeys("".join(s for _, s in operands) + out))
    for letter in letters:
        roles = {name: place(specs[name], sub, letter) for name, sub in operands}
        if letter in out:
            if bias_spec is not None:
                roles[bias] = place(bias_spec, bias_sub, letter)  # type: ignore[index]
            found.append(a.strategy(roles, Shard(out.index(letter))))
        elif can_p and all(isinstance(roles[n], Shard) for n, s in operands if letter in s):
            if bias_spec is not None:
                roles[bias] = P  # type: ignore[index]
            found.append(a.strategy(roles, P))
    if can_p:
        for name, _ in operands:
            if is_float(specs[name]):
                roles = {name: P}
                if bias_spec is not None:
                    if not is_float(bias_spec):
                        continue
                    roles[bias] = P  # type: ignore[index]
                found.append(a.strategy(roles, P))
    return found


def product(operands: tuple[int, int], k_dim: int) -> OpCost:
    """Cost facts of a product whose operands are ``op.inputs[operands]``: ``2 * |out| * k`` FLOPs,
    with ``k`` the second operand's dim ``k_dim`` (the contracted length)."""

    def flops(op: OpSpec) -> float:
        return 2.0 * math.prod(op.outputs[0].shape) * op.inputs[operands[1]].shape[k_dim]

    return OpCost(flops=flops, operands=operands)


@register("aten.mm.default", family="matmul", cost=product((0, 1), -2))
def mm(op: OpSpec) -> list[Strategy1D]:
    """``mk,kn->mn``."""
    return einsum_strategies(Args(op), [("self", "mk"), ("mat2", "kn")], "mn")


@register("aten.bmm.default", family="matmul", cost=product((0, 1), -2))
def bmm(op: OpSpec) -> list[Strategy1D]:
    """``bmk,bkn->bmn``."""
    return einsum_strategies(Args(op), [("self", "bmk"), ("mat2", "bkn")], "bmn")


@register("aten.addmm.default", family="matmul", cost=product((1, 2), -2))
def addmm(op: OpSpec) -> list[Strategy1D]:
    """``beta * self + alpha * (mk,kn->mn)``; ``self`` broadcasts to ``mn``."""
    return einsum_strategies(Args(op), [("mat1", "mk"), ("mat2", "kn")], "mn", bias="self")


@register("aten.baddbmm.default", family="matmul", cost=product((1, 2), -2))
def baddbmm(op: OpSpec) -> list[Strategy1D]:
    """``beta * self + alpha * (bmk,bkn->bmn)``; ``self`` broadcasts to ``bmn``."""
    return einsum_strategies(Args(op), [("batch1", "bmk"), ("batch2", "bkn")], "bmn", bias="self")


_BATCH = string.ascii_uppercase  # batch-dim letters; m, n, k are the matrix indices


@register("aten.linear.default", family="matmul", cost=product((0, 1), -1))
def linear(op: OpSpec) -> list[Strategy1D]:
    """``...k,nk->...n`` (``...k,k->...`` for a 1-D weight) plus bias ``n``."""
    a = Args(op)
    x, w = a.spec("input"), a.spec("weight")
    assert x is not None and w is not None
    batch = _BATCH[: x.ndim - 1]
    w_sub = "nk" if w.ndim == 2 else "k"
    return einsum_strategies(a, [("input", batch + "k"), ("weight", w_sub)], batch + w_sub[:-1], bias="bias")


@register("aten.matmul.default", family="matmul", cost=product((0, 1), -2))
def matmul(op: OpSpec) -> list[Strategy1D]:
    """``torch.matmul``: 1-D operands get/lose a matrix index, batch dims broadcast (right-aligned)."""
    a = Args(op)
    x, y = a.spec("self"), a.spec("other")
    assert x is not None and y is not None
    nb = max(x.ndim - 2, y.ndim - 2, 0)
    batch = _BATCH[:nb]
    x_sub = "k" if x.ndim == 1 else batch[nb - (x.ndim - 2):] + "mk"
    y_sub = "k" if y.ndim == 1 else batch[nb - (y.ndim - 2):] + "kn"
    out = batch + ("m" if x.ndim > 1 else "") + ("n" if y.ndim > 1 else "")
    return einsum_strategies(a, [("self", x_sub), ("other", y_sub)], out)


def einsum_subscripts(equation: str, ranks: Sequence[int]) -> tuple[list[str], str]:
    """``torch.einsum``'s equation as one letter per dim of each operand and of the output: spaces dropped,
    ``...`` replaced by letters the equation does not use (right-aligned across operands, as it broadcasts),
    an implicit output (no ``->``) made explicit (the broadcast dims, then the letters used once, sorted)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    dots = max((r - (len(s) - 3) for s, r in zip(subs, ranks) if "..." in s), default=0)
    fill = "".join(c for c in string.ascii_letters if c not in eq)[:dots]
    subs = [s.replace("...", fill[dots - (r - (len(s) - 3)):]) if "..." in s else s for s, r in zip(subs, ranks)]
    if arrow:
        out = rhs.replace("...", fill)
    else:
        letters = "".join(subs)
        out = fill + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in fill))
    return subs, out


def _einsum_flops(op: OpSpec) -> float:
    """``2 * prod(every index's length)``: one multiply-add per term of the sum."""
    a = Args(op)
    subs, _ = einsum_subscripts(a["equation"], [s.ndim for s in a["tensors"]])
    size: dict[str, int] = {}
    for sub, spec in zip(subs, a["tensors"]):
        for letter, n in zip(sub, spec.shape):
            size[letter] = max(size.get(letter, 1), n)
    return 2.0 * math.prod(size.values())


@register("aten.einsum.default", family="matmul", cost=OpCost(flops=_einsum_flops, backward=2.0))
def einsum(op: OpSpec) -> list[Strategy1D]:
    """``torch.einsum(equation, tensors)``: a free index splits on every operand that carries it at full length
    and on the output; a contracted index carried at full length by every operand that has it gives ``P``;
    linear in each operand (that one ``P``, the others ``R``)."""
    a = Args(op)
    specs: list[TensorSpec] = list(a["tensors"])
    subs, out = einsum_subscripts(a["equation"], [s.ndim for s in specs])
    size: dict[str, int] = {}
    for sub, spec in zip(subs, specs):
        for letter, n in zip(sub, spec.shape):
            size[letter] = max(size.get(letter, 1), n)
    can_p = outputs_float(op)

    def place(spec: TensorSpec, sub: str, letter: str) -> Placement:
        return Shard(sub.index(letter)) if letter in sub and spec.shape[sub.index(letter)] == size[letter] else R

    found: list[Strategy1D] = []
    for letter in dict.fromkeys("".join(subs)):
        pls = [place(spec, sub, letter) for spec, sub in zip(specs, subs)]
        if letter in out:
            found.append(a.strategy({"tensors": pls}, Shard(out.index(letter))))
        elif can_p and all(isinstance(p, Shard) for p, sub in zip(pls, subs) if letter in sub):
            found.append(a.strategy({"tensors": pls}, P))
    if can_p:
        for i, spec in enumerate(specs):
            if is_float(spec):
                found.append(a.strategy({"tensors": [P if j == i else R for j in range(len(specs))]}, P))
    return found
