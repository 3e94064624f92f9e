"""Elementwise ops (unary, binary/ternary with NumPy broadcasting, their in-place forms).

Maths: ``out[i] = f(x[i], y[i], ...)`` with broadcasting, so every output dim
can be sharded: each input shards the dim that carries it (same size) and is
``R`` where it broadcasts (size 1 or missing).  Partial inputs are allowed only
where ``f`` is linear in them: ``f(sum_k x_k) = sum_k f(x_k)``:

* ``add``/``sub`` of two tensors, ``where(c, a, b)``: jointly linear in the
  data operands -> all of them ``P`` (``c`` ``R``).  ``add(x, 1.0)`` is affine, not linear.
* ``mul``: linear in each factor separately -> one factor ``P``, the other ``R``.
* ``div``: linear in the numerator only.
* ``mul``/``div`` by a Python scalar ``c``: linear in exact arithmetic at any ``c``, but the summands of a pending
  sum are not the sum: ``x_k c`` overflows to ``inf`` where ``(sum_k x_k) c`` does not (``sum_k x_k = 0`` with
  ``x_k = +-1``, times ``finfo.min``: ``inf - inf = nan``), so ``P`` only where ``|c|`` (``|1 / c|``) leaves
  ``HEADROOM`` under the type's largest value.  The ``(1 - mask) * finfo.min`` of BERT-style attention masks
  keeps its input whole (LayoutLM: NaN under a pending sum).
* ``masked_fill``/``where`` with a Python scalar: linear only when the scalar is 0; ``fill`` (``self``
  replaced everywhere by ``value``): linear in a tensor ``value``, or zero.
* copies/casts (``clone``, ``alias``, ``to`` between float dtypes), ``neg``,
  ``dropout`` with ``p == 0`` or in eval: linear.

Integer or bool tensors are never ``P`` (checked by ``partial_strategies``).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._common import Args, P, R, Shard, bcast, free_placements, partial_strategies
from .base import ELEMENTWISE, VIEW, OpSpec, Strategy1D, register

# op -> the groups of arguments the op is linear in (each group all-P, rest R)
LinearFn = Callable[[Args], list[list[str]]]


def _none(a: Args) -> list[list[str]]:
    return []


def _self(a: Args) -> list[list[str]]:
    return [["self"]]


def _both_tensors(a: Args) -> list[list[str]]:
    return [["self", "other"]] if a.spec("self") and a.spec("other") else []


# How far under the largest value of its type a scalar factor keeps a summand times it (``mul``/``div`` by a Python
# scalar): a pending sum's summands may exceed the sum by this much before ``x_k c`` overflows.
HEADROOM = 2.0 ** 8


def _bounded(a: Args, factor: float) -> bool:
    """Can summands of the tensor operand be scaled by ``factor`` (module docstring: finite, ``HEADROOM`` under
    the type's largest value)?"""
    t = a.spec("self") or a.spec("other")
    top = torch.finfo(t.dtype).max if t is not None and t.dtype.is_floating_point else float("inf")
    return math.isfinite(factor) and abs(factor) * HEADROOM <= top


def _each_factor(a: Args) -> list[list[str]]:
    scalar = next((a[n] for n in ("self", "other") if isinstance(a[n], (int, float)) and not a.spec(n)), None)
    if scalar is not None and not _bounded(a, float(scalar)):
        return []
    return [[n] for n in ("self", "other") if a.spec(n)]


def _numerator(a: Args) -> list[list[str]]:
    d = a["other"]
    if isinstance(d, (int, float)) and not a.spec("other") and (d == 0 or not _bounded(a, 1.0 / float(d))):
        return []
    return [["self"]]


def _cast(a: Args) -> list[list[str]]:
    return [["self"]]  # partial_strategies drops it unless input and output are float


def _dropout(a: Args) -> list[list[str]]:
    return [["input"]] if a["p"] == 0 or not a["train"] else []


def _masked_fill_scalar(a: Args) -> list[list[str]]:
    return [["self"]] if a["value"] == 0 else []


def _masked_fill_tensor(a: Args) -> list[list[str]]:
    return [["self", "value"]]


def _where(a: Args) -> list[list[str]]:
    return [["self", "other"]]


def _where_scalar_other(a: Args) -> list[list[str]]:
    return [["self"]] if a["other"] == 0 else []


def _where_scalar_self(a: Args) -> list[list[str]]:
    return [["other"]] if a["self"] == 0 else []


def _fill_scalar(a: Args) -> list[list[str]]:
    return [["self"]] if a["value"] == 0 else []  # zeros: every summand zero


def _fill_tensor(a: Args) -> list[list[str]]:
    return [["value"]]  # the output is ``value`` broadcast: linear in it (``self`` only gives the shape)


def pointwise(op: OpSpec, linear: LinearFn = _none) -> list[Strategy1D]:
    """Shard every output dim (inputs follow by broadcasting); ``P`` where linear."""
    a = Args(op)
    out_shape = op.outputs[0].shape
    found = [
        Strategy1D(tuple(bcast(s, out_shape, d) for s in op.inputs), tuple(Shard(d) for _ in op.outputs))
        for d in range(len(out_shape))
    ]
    return found + partial_strategies(a, linear(a))


def _rule(linear: LinearFn) -> Callable[[OpSpec], list[Strategy1D]]:
    def rule(op: OpSpec) -> list[Strategy1D]:
        return pointwise(op, linear)

    rule.__doc__ = f"pointwise, linear groups from {linear.__name__}"
    return rule


NONLINEAR_UNARY = (
    "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "tanh", "sigmoid", "exp", "exp_", "log", "log1p", "rsqrt",
    "sqrt", "abs", "sin", "cos", "erf", "reciprocal", "square", "hardtanh", "hardtanh_", "relu6", "leaky_relu", "elu",
    "softplus", "mish", "hardswish", "hardsigmoid", "logical_not", "bitwise_not", "clamp_min", "clamp_max",
    "sign", "floor", "ceil", "round", "expm1", "log_sigmoid",
    # the rest of torch's elementwise maths (YOSO's hashing reads acos)
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "log2", "log10", "exp2", "trunc",
    "erfc", "erfinv", "sgn", "isnan", "isinf", "isfinite", "isposinf", "isneginf",
)

TABLE: dict[str, LinearFn] = {
    **{f"aten.{n}.default": _none for n in NONLINEAR_UNARY},
    "aten.pow.Tensor_Scalar": _none,
    "aten.pow.Tensor_Tensor": _none,
    "aten.pow.Scalar": _none,  # a Python base to a tensor power
    "aten.max.other": _none,
    "aten.min.other": _none,
    "aten.clamp.default": _none,
    "aten.clamp_.default": _none,  # in place (Gemma 3n's activation sparsity)
    "aten.clamp.Tensor": _none,  # tensor bounds, broadcast as any operand (PhiMoE's router)
    "aten.rsub.Scalar": _none,  # other - alpha * self: affine
    # linear unary: copies, casts, negation
    "aten.neg.default": _self,
    "aten.clone.default": _self,
    "aten.lift_fresh_copy.default": _self,
    "aten.detach_.default": _self,
    "aten.contiguous.default": _self,
    "aten.alias.default": _self,
    "aten.detach.default": _self,
    "aten.to.dtype": _cast,
    "aten.to.dtype_layout": _cast,
    "aten._to_copy.default": _cast,
    "aten.to.device": _cast,
    "aten.dropout.default": _dropout,
    # binary arithmetic (second operand may be a Python scalar)
    "aten.add.Tensor": _both_tensors,
    "aten.sub.Tensor": _both_tensors,
    "aten.add_.Tensor": _both_tensors,
    "aten.sub_.Tensor": _both_tensors,
    "aten.mul.Tensor": _each_factor,
    "aten.multiply.Tensor": _each_factor,
    "aten.mul_.Tensor": _each_factor,
    "aten.div.Tensor": _numerator,
    "aten.div_.Tensor": _numerator,
    "aten.floor_divide.default": _none,
    "aten.div.Tensor_mode": _none,  # rounded (floor, trunc): not linear
    "aten.div.Scalar_mode": _none,
    "aten.remainder.Scalar": _none,
    "aten.remainder.Tensor": _none,
    "aten.maximum.default": _none,
    "aten.minimum.default": _none,
    "aten.logical_and.default": _none,
    "aten.logical_or.default": _none,
    **{f"aten.{n}.Tensor": _none for n in ("__and__", "__or__", "bitwise_and", "bitwise_or")},
    **{f"aten.{c}.{o}": _none for c in ("eq", "ne", "lt", "le", "gt", "ge") for o in ("Tensor", "Scalar")},
    # their long names (``torch.greater`` in Switch Transformers' router), separate overloads of the same ops
    **{f"aten.{c}.{o}": _none for c in ("greater", "greater_equal", "less", "less_equal", "not_equal")
       for o in ("Tensor", "Scalar")},
    # selection
    "aten.where.self": _where,
    "aten.where.ScalarOther": _where_scalar_other,
    "aten.where.ScalarSelf": _where_scalar_self,
    "aten.where.Scalar": _none,  # two Python scalars chosen by a condition
    "aten.polar.default": _none,  # abs * exp(i angle): a complex tensor from two real ones
    "aten.masked_fill.Scalar": _masked_fill_scalar,
    "aten.masked_fill_.Scalar": _masked_fill_scalar,  # in place on a value forward made (FSMT's attention)
    "aten.masked_fill.Tensor": _masked_fill_tensor,
    # ``self`` everywhere replaced by ``value`` (what an in-place ``fill_`` becomes: ``capture.passes.functionalize``)
    "aten.fill.Scalar": _fill_scalar,
    "aten.fill.Tensor": _fill_tensor,
}

# Aliases of their input: free for the cost model.
ALIASES = frozenset({"aten.alias.default", "aten.detach.default"})

for _name, _lin in TABLE.items():
    register(_name, family="elementwise", cost=VIEW if _name in ALIASES else ELEMENTWISE)(_rule(_lin))


@register("aten.type_as.default", family="elementwise", cost=ELEMENTWISE)
def type_as(op: OpSpec) -> list[Strategy1D]:
    """``self.to(other.dtype)``: ``other``'s values are unused, so it may be placed anyhow.

    ``self`` X -> out X for every sharding X (and ``P`` between floats), with
    ``other`` ``R`` or, when it has ``self``'s shape, placed like ``self``;
    plus ``self`` ``R`` with ``other`` in any placement (out ``R``).
    """
    a = Args(op)
    self_, other = a.spec("self"), a.spec("other")
    assert self_ is not None and other is not None
    found: list[Strategy1D] = []
    partial_ok = a.all_float("self") and op.outputs[0].dtype.is_floating_point
    moves = [Shard(d) for d in range(self_.ndim)] + ([P] if partial_ok else [])
    for x in moves:
        found.append(a.strategy({"self": x, "other": R}, x))
        if other.shape == self_.shape and (x != P or a.all_float("other")):
            found.append(a.strategy({"self": x, "other": x}, x))
    for y in free_placements(other):
        if y != R:
            found.append(a.strategy({"self": R, "other": y}, R))
    return found
