"""Every registered op declares its cost facts where its rule is registered, and they agree with the op.

``rules.base.register(..., cost=OpCost(...))`` is the one home of what the cost model knows about an
op beyond its shapes: is it a view, its FLOPs, its product operands.  An op registered without them
fails here; so does a view fact that contradicts the op's schema (a return that aliases an input)
unless the exception is listed below with its reason; so do product operands that do not name the
two tensors whose dims the FLOPs formula contracts.
"""
from __future__ import annotations

import math

import pytest
import torch

from soybean import rules
from soybean.cost.compute import facts, flops, passes
from soybean.rules.base import ELEMENTWISE, REGISTRY, OpCost, TensorSpec, make_opspec

pytestmark = pytest.mark.unit

# Ops whose view fact differs from their schema's alias annotation, on purpose.
SCHEMA_EXCEPTIONS = {
    "aten._unsafe_view.default": "a view whose schema does not say so (autograd uses it after a copy)",
    "aten.broadcast_tensors.default": "returns expanded views; the schema of a tensor list is unannotated",
    "aten.contiguous.default": "aliases only when already contiguous; priced as the copy it may be",
    "aten.to.device": "aliases only when nothing changes; priced as the copy it may be",
    "aten.to.dtype": "aliases only when nothing changes; priced as the copy it may be",
    "aten.to.dtype_layout": "aliases only when nothing changes; priced as the copy it may be",
}


def _target(name: str) -> torch._ops.OpOverload:
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def test_every_registered_op_declares_cost_facts() -> None:
    missing = sorted(n for n, e in REGISTRY.items() if not isinstance(e.cost, OpCost))
    assert not missing, f"register(..., cost=OpCost(...)) is missing for: {missing}"


def test_view_facts_agree_with_the_schemas() -> None:
    disagree = {}
    for name, entry in REGISTRY.items():
        returns = _target(name)._schema.returns
        aliases = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        assert entry.cost is not None
        if aliases != entry.cost.view:
            disagree[name] = (aliases, entry.cost.view)
    assert set(disagree) == set(SCHEMA_EXCEPTIONS), f"schema alias vs declared view: {disagree}"


def _products() -> list[tuple[str, tuple[torch.Tensor, ...], float, int]]:
    """(op, example inputs, its FLOPs counted by hand, the index of its first operand)."""
    r = torch.randn
    return [
        ("aten.mm.default", (r(4, 8), r(8, 6)), 2.0 * 4 * 6 * 8, 0),
        ("aten.bmm.default", (r(2, 4, 8), r(2, 8, 6)), 2.0 * 2 * 4 * 6 * 8, 0),
        ("aten.addmm.default", (r(6), r(4, 8), r(8, 6)), 2.0 * 4 * 6 * 8, 1),
        ("aten.baddbmm.default", (r(2, 4, 6), r(2, 4, 8), r(2, 8, 6)), 2.0 * 2 * 4 * 6 * 8, 1),
        ("aten.linear.default", (r(4, 8), r(6, 8)), 2.0 * 4 * 6 * 8, 0),
        ("aten.matmul.default", (r(3, 4, 8), r(8, 6)), 2.0 * 3 * 4 * 6 * 8, 0),
        ("aten.conv1d.default", (r(2, 3, 7), r(4, 3, 3)), 2.0 * (2 * 4 * 5) * (3 * 3), 0),
        ("aten.conv2d.default", (r(2, 3, 5, 5), r(4, 3, 3, 3)), 2.0 * (2 * 4 * 3 * 3) * (3 * 9), 0),
        ("aten.conv3d.default", (r(1, 2, 4, 4, 4), r(3, 2, 2, 2, 2)), 2.0 * (3 * 27) * (2 * 8), 0),
        # transposed: every input element meets every tap of every output channel
        ("aten.conv_transpose1d.default", (r(2, 3, 7), r(3, 4, 3)), 2.0 * (2 * 3 * 7) * (4 * 3), 0),
    ]


def test_every_product_is_checked() -> None:
    declared = {n for n, e in REGISTRY.items() if e.cost is not None and e.cost.operands and ".default" in n}
    assert declared == {name for name, *_ in _products()}


@pytest.mark.parametrize("name,args,want,first", _products(), ids=[p[0] for p in _products()])
def test_product_facts(name: str, args: tuple[torch.Tensor, ...], want: float, first: int) -> None:
    """FLOPs are 2 x output x contracted length, and the backward counts exactly the operands that need
    a gradient (a bias is not an operand): a wrong operand index or contracted dim fails here."""
    op = _op(_target(name), *args)
    assert flops(op)[0] == want
    grads = [False] * len(args)
    assert passes(op, grads) == 1.0
    grads[first] = True
    assert passes(op, grads) == 2.0
    grads[first + 1] = True
    assert passes(op, grads) == 3.0
    if first:  # the bias alone needs no product
        assert passes(op, [True] + [False] * (len(args) - 1)) == 1.0


def _op(target: torch._ops.OpOverload, *args: torch.Tensor) -> object:
    return make_opspec(target, args, {}, target(*args))


def test_facts_price_the_ops() -> None:
    """The facts reach the cost model: a view is free, a product's backward counts its operands,
    a linear layer's FLOPs are 2 m n k, and an op without a rule is priced as elementwise."""
    aten = torch.ops.aten
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    lin = _op(aten.linear.default, x, w)
    assert flops(lin)[0] == 2.0 * 4 * 6 * 8
    assert passes(lin, [True, True]) == 3.0 and passes(lin, [False, True]) == 2.0
    assert passes(_op(aten.t.default, x), [True]) == 0.0
    assert passes(_op(aten.relu.default, x), [True]) == 2.0
    q = torch.randn(2, 3, 5, 4)
    sdpa = _op(aten.scaled_dot_product_attention.default, q, q, q)
    assert passes(sdpa, [True, True, True]) == 3.5 and flops(sdpa)[0] == 4.0 * math.prod(q.shape) * 5
    unknown = make_opspec("aten.some_op.default", (TensorSpec((3,), torch.float32),), {}, None)
    assert rules.lookup(unknown.target) is None and facts(unknown) is ELEMENTWISE
