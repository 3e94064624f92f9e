"""Every registered sharding rule, validated against the serial op.

``CASES`` lists realistic small calls of every registered op; each is checked
with ``check_op`` (all N-D strategies, every device simulated) on a 2-way, an
uneven 3-way (sizes 5 and 7) and a 2x2 mesh, and must check a real split on each
(a strategy besides all-R), unless marked ``splits=False``: arguments for which
the rule deliberately lists nothing, checked to stay so.  Further tests make sure no rule
can be registered without a case, that rules really split work, that integers
are never ``P``, and that the validator rejects wrong strategies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from soybean.ir.experts import OP as ROUTED_EXPERTS
from soybean.mesh import Mesh
from soybean.rules import REGISTRY, expand, make_opspec, strategies_1d
from soybean.rules.base import OpSpec, RuleEntry, Strategy1D, has_empty_tile, op_name
from soybean.verify.validate import check_op
from soybean.tiling import P, R, Partial, S

pytestmark = pytest.mark.unit

aten = torch.ops.aten
MESHES = [Mesh((2,)), Mesh((3,)), Mesh((2, 2))]
_gen = torch.Generator().manual_seed(1234)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=_gen).to(dtype)


def pos(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_gen) + 0.5


def ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_gen)


def mask(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_gen) > 0.5


@dataclass
class Case:
    target: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    tol: float = 1e-5
    splits: bool = True  # False: the rule lists no strategy for these arguments, on any mesh

    @property
    def name(self) -> str:
        return op_name(self.target)

    def opspec(self) -> OpSpec:
        fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in self.args]
        return make_opspec(self.target, tuple(fresh), self.kwargs, self.target(*fresh, **self.kwargs))


CASES: list[Case] = []


def case(target: Any, *args: Any, tol: float = 1e-5, splits: bool = True, **kwargs: Any) -> None:
    CASES.append(Case(target, args, kwargs, tol, splits))


# ---- elementwise -------------------------------------------------------------------------
X = randn(6, 5, 7)
for _n in ("relu", "relu_", "gelu", "gelu_", "silu", "silu_", "tanh", "sigmoid", "exp", "exp_", "abs", "sin", "cos", "erf",
           "square", "hardtanh", "hardtanh_", "relu6", "leaky_relu", "elu", "softplus", "mish", "hardswish",
           "hardsigmoid", "sign", "floor", "ceil", "round", "neg", "clone", "contiguous", "alias", "detach"):
    case(getattr(aten, _n).default, X)
case(aten.expm1.default, X)
for _n in ("tan", "atan", "sinh", "cosh", "asinh", "exp2", "trunc", "erfc", "sgn"):
    case(getattr(aten, _n).default, X)
for _n in ("isnan", "isinf", "isfinite", "isposinf", "isneginf"):  # on values that have some of each
    case(getattr(aten, _n).default, torch.where(X > 1, torch.inf, torch.where(X < -1, -torch.inf, X)).where(
        X.abs() < 1.5, torch.nan))
for _n in ("asin", "acos", "atanh", "erfinv"):  # defined on (-1, 1)
    case(getattr(aten, _n).default, 0.9 * X.tanh())
for _n in ("log2", "log10"):
    case(getattr(aten, _n).default, pos(6, 5, 7))
case(aten.acosh.default, 1.0 + pos(6, 5, 7))
case(aten.log_sigmoid.default, X)
case(aten.polar.default, pos(6, 5), randn(5))
case(aten.where.Scalar, mask(6, 5), 1.0, 0.0)
for _n in ("log", "log1p", "rsqrt", "sqrt", "reciprocal"):
    case(getattr(aten, _n).default, pos(6, 5, 7))
case(aten.gelu.default, X, approximate="tanh")
case(aten.leaky_relu.default, X, 0.2)
case(aten.logical_not.default, mask(6, 7))
case(aten.bitwise_not.default, ints(9, 5, 6))
case(aten.pow.Tensor_Scalar, X, 2)
case(aten.clamp.default, X, -0.5, 0.5)
case(aten.clamp_.default, X, None, 0.5)  # in place (Gemma 3n)
case(aten.clamp_min.default, X, 0.0)
case(aten.clamp_max.default, X, 0.1)
case(aten.rsub.Scalar, X, 1.0)
case(aten.to.dtype, X, torch.float64)
case(aten.to.dtype, X, torch.int64)
case(aten.to.dtype_layout, X, dtype=torch.float64)
case(aten._to_copy.default, X, dtype=torch.float64)
case(aten._to_copy.default, ints(9, 5, 6), dtype=torch.float32)
case(aten.to.device, X, torch.device("cpu"), torch.float64)
case(aten.dropout.default, X, 0.0, True)
case(aten.dropout.default, X, 0.5, False)
case(aten.type_as.default, X, randn(6, 5, 7, dtype=torch.float64))
case(aten.type_as.default, randn(5, 4), randn(7, dtype=torch.float64))

Y = randn(5, 1)  # broadcasts against X (6, 5, 7)
for _op in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.maximum.default, aten.minimum.default):
    case(_op, X, Y)
    case(_op, Y, X)
case(aten.add.Tensor, X, randn(6, 5, 7), alpha=2)
case(aten.add.Tensor, X, 1.5)
case(aten.add.Tensor, X, torch.tensor(0.5))
case(aten.sub.Tensor, X, 2.0, alpha=3)
case(aten.mul.Tensor, X, 3.0)
case(aten.mul.Tensor, X, ints(3, 5, 7))
case(aten.mul.Tensor, ints(3, 6, 5), ints(3, 5))
case(aten.div.Tensor, X, pos(1, 5, 7))
case(aten.div.Tensor, X, 4.0)
case(aten.clamp.Tensor, X, randn(5, 7), randn(7) + 1.0)
case(aten.masked_fill_.Scalar, X, mask(5, 7), -3.0)
case(aten.concat.default, [X, randn(6, 2, 7)], 1)
case(aten.glu.default, randn(6, 5, 8), 2)
case(aten.glu.default, randn(6, 4, 7), 1)
case(aten.real.default, torch.complex(X, randn(6, 5, 7)))
case(aten.imag.default, torch.complex(X, randn(6, 5, 7)))
case(aten.fft_fftn.default, X, None, [1, 2])
case(aten.fft_fftn.default, X)
case(aten.fft_fft.default, X, None, 0)
case(aten.fft_ifft.default, torch.complex(X, randn(6, 5, 7)))
case(aten.fft_ifftn.default, torch.complex(X, randn(6, 5, 7)), None, [0, 2])
# a scalar so large (or so small a divisor) that summands of a pending sum times it overflow: no ``P`` (below)
X32 = X.float()
case(aten.mul.Tensor, X32, torch.finfo(torch.float32).min)
case(aten.div.Tensor, X32, 1e-37)
for _op in (aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor):
    case(_op, X, Y)
case(aten.div_.Tensor, X, pos(7))
case(aten.floor_divide.default, ints(20, 6, 5), ints(3, 5) + 1)
case(aten.pow.Tensor_Tensor, pos(6, 5, 7), randn(5, 1))
case(aten.pow.Scalar, 2.0, randn(6, 5))
case(aten.max.other, X, Y)
case(aten.min.other, Y, X)
case(aten.multiply.Tensor, X, Y)
case(aten.fill.Scalar, X, 0.0)
case(aten.fill.Scalar, X, 2.5)
case(aten.fill.Tensor, X, torch.tensor(1.5))
case(aten.logical_and.default, mask(6, 5), mask(5))
case(aten.logical_or.default, mask(6, 5), mask(6, 1))
case(aten.__and__.Tensor, mask(6, 5), mask(5))
case(aten.__and__.Tensor, torch.tensor(True), mask(4, 3, 5, 5))
case(aten.__or__.Tensor, mask(6, 5), mask(6, 1))
case(aten.bitwise_and.Tensor, ints(9, 6, 5), ints(9, 5))
case(aten.bitwise_or.Tensor, ints(9, 6, 5), ints(9, 6, 1))
for _c in ("eq", "ne", "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal"):
    case(getattr(aten, _c).Tensor, X.round(), Y.round())
    case(getattr(aten, _c).Scalar, X.round(), 0.0)
case(aten.where.self, mask(5, 7), X, randn(6, 1, 7))
case(aten.where.ScalarOther, mask(6, 5, 1), X, 0.0)
case(aten.where.ScalarOther, mask(6, 5, 1), X, 1.5)
case(aten.where.ScalarSelf, mask(7), 0.0, X)
case(aten.masked_fill.Scalar, X, mask(5, 7), 0.0)
case(aten.masked_fill.Scalar, X, mask(6, 1, 7), -1e9)
case(aten.masked_fill.Tensor, X, mask(5, 7), torch.tensor(0.25))
case(aten.broadcast_tensors.default, [randn(5, 1), randn(6, 1, 7), randn(7)])

# ---- contractions ------------------------------------------------------------------------
case(aten.mm.default, randn(6, 7), randn(7, 5))
case(aten.bmm.default, randn(4, 5, 7), randn(4, 7, 6))
case(aten.addmm.default, randn(5), randn(6, 7), randn(7, 5))
case(aten.addmm.default, randn(6, 5), randn(6, 7), randn(7, 5), beta=0.5, alpha=2.0)
case(aten.addmm.default, randn(1, 5), randn(6, 7), randn(7, 5))
case(aten.baddbmm.default, randn(4, 5, 6), randn(4, 5, 7), randn(4, 7, 6))
case(aten.baddbmm.default, randn(5, 1), randn(4, 5, 7), randn(4, 7, 6), beta=2.0, alpha=0.5)
case(aten.linear.default, randn(2, 5, 7), randn(6, 7), randn(6), tol=1e-4)
case(aten.linear.default, randn(6, 7), randn(5, 7))
case(aten.linear.default, randn(6, 7), randn(7))
case(aten.linear.default, randn(6, 7), randn(5, 7), bias=randn(5))  # tensors passed as kwargs
case(aten.matmul.default, randn(7), randn(7))
case(aten.matmul.default, randn(6, 7), randn(7))
case(aten.matmul.default, randn(7), randn(2, 7, 5))
case(aten.matmul.default, randn(2, 1, 5, 7), randn(3, 7, 4))
case(aten.matmul.default, randn(4, 5, 7), randn(7, 6))
case(aten.einsum.default, "bhld,bhmd->bhlm", [randn(2, 4, 5, 6), randn(2, 4, 7, 6)])
case(aten.einsum.default, "...ij,jk", [randn(3, 2, 5, 6), randn(6, 4)])
case(aten.einsum.default, "bi,bi->b", [randn(6, 5), randn(6, 5)])
case(aten.einsum.default, "ij->", [randn(6, 5)])

Q, K, V = randn(2, 3, 5, 4), randn(2, 3, 7, 4), randn(2, 3, 7, 6)
case(aten.scaled_dot_product_attention.default, Q, K, V)
case(aten.scaled_dot_product_attention.default, Q, K, V, randn(5, 7))
case(aten.scaled_dot_product_attention.default, Q, K, V, attn_mask=randn(3, 1, 7))
case(aten.scaled_dot_product_attention.default, Q, K, V, mask(2, 1, 5, 7) | torch.eye(5, 7, dtype=torch.bool), scale=0.3)
case(aten.scaled_dot_product_attention.default, Q, Q, randn(2, 3, 5, 6), is_causal=True)
# causal with the query rows split (batch 1, GQA): each tile's mask offset by its first row
case(aten.scaled_dot_product_attention.default, randn(1, 4, 7, 4), randn(1, 2, 7, 4), randn(1, 2, 7, 4),
     is_causal=True, enable_gqa=True)
case(aten.scaled_dot_product_attention.default, randn(2, 4, 5, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 4), enable_gqa=True)

# ---- convolution and pooling -------------------------------------------------------------
IMG = randn(4, 6, 7, 5)
case(aten.conv2d.default, IMG, randn(5, 6, 3, 3), randn(5), tol=1e-4)
case(aten.conv2d.default, IMG, randn(4, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], 2, tol=1e-4)
case(aten.conv2d.default, randn(6, 7, 5), randn(5, 6, 3, 3), tol=1e-4)
case(aten.conv2d.padding, IMG, randn(5, 6, 3, 3), randn(5), [1, 1], "same", tol=1e-4)
case(aten.conv1d.default, randn(4, 6, 9), randn(5, 6, 3), randn(5), [2], tol=1e-4)
case(aten.conv1d.padding, randn(4, 6, 9), randn(5, 6, 3), None, [1], "same", tol=1e-4)
case(aten.conv3d.default, randn(2, 4, 5, 5, 5), randn(3, 4, 3, 3, 3), randn(3), tol=1e-4)
case(aten.conv3d.padding, randn(2, 4, 5, 5, 5), randn(3, 4, 3, 3, 3), None, [1, 1, 1], "same", tol=1e-4)

case(aten.max_pool1d.default, randn(4, 5, 9), [2])
case(aten.max_pool2d.default, IMG, [2, 2])
case(aten.max_pool2d.default, randn(6, 7, 7), [3, 3], [2, 2], [1, 1])
case(aten.max_pool3d.default, randn(2, 5, 4, 4, 4), [2, 2, 2])
case(aten.max_pool2d_with_indices.default, IMG, [2, 2])
case(aten.adaptive_max_pool2d.default, IMG, [2, 2])
case(aten.avg_pool1d.default, randn(4, 5, 9), [3])
case(aten.avg_pool2d.default, IMG, [2, 2], [1, 1], [1, 1], True, False)
case(aten.avg_pool3d.default, randn(2, 5, 4, 4, 4), [2, 2, 2])
case(aten.adaptive_avg_pool1d.default, randn(4, 5, 9), [3])
# Spatial splits with halos (rules.window): strided, dilated, padded, uneven, thinner than the halo.
case(aten.conv2d.default, randn(2, 2, 9, 7), randn(3, 2, 3, 3), randn(3), [2, 1], [1, 2], [1, 2], tol=1e-4)
case(aten.conv1d.default, randn(2, 2, 11), randn(3, 2, 5), None, [3], [2], [2], tol=1e-4)
case(aten.conv1d.default, randn(2, 2, 5), randn(2, 2, 5), None, [1], [2], tol=1e-4)  # 5 rows on 3-4 members
case(aten.conv1d.padding, randn(2, 2, 9), randn(3, 2, 3), None, [1], "valid", tol=1e-4)
case(aten.conv3d.default, randn(2, 2, 6, 5, 4), randn(2, 2, 3, 3, 3), None, [1, 2, 1], [1, 1, 0], tol=1e-4)
case(aten.conv_transpose1d.default, randn(2, 3, 6), randn(3, 2, 3), randn(2), [2], [1], [1], tol=1e-4)
case(aten.conv_transpose2d.input, randn(2, 4, 5, 4), randn(4, 3, 2, 2), randn(3), [2, 2], tol=1e-4)
case(aten.conv_transpose2d.input, randn(2, 4, 5, 4), randn(4, 3, 1, 1), None, [3, 2], tol=1e-4)  # kernel < stride
case(aten.conv_transpose2d.input, randn(2, 4, 5, 5), randn(4, 2, 3, 3), randn(4), [1, 1], [1, 1], [0, 0], 2,
     tol=1e-4)  # grouped
case(aten.conv_transpose3d.input, randn(2, 2, 3, 4, 3), randn(2, 2, 3, 3, 3), None, [2, 1, 1], [1, 1, 1], tol=1e-4)
case(aten.im2col.default, randn(3, 4, 5, 6), [3, 1], [1, 1], [1, 0], [1, 1])  # convbert's span convolution
case(aten.im2col.default, randn(4, 5, 6), [2, 2], [1, 1], [0, 0], [2, 2])
case(aten.max_pool2d.default, randn(2, 2, 9, 8), [3, 3], [2, 2], [1, 1], [1, 1], True)
case(aten.max_pool1d.default, randn(2, 3, 10), [3], [2], [1], [2])
case(aten.avg_pool2d.default, randn(2, 2, 9, 8), [3, 3], [2, 2], [1, 1], True, True)
case(aten.avg_pool2d.default, randn(2, 2, 9, 8), [3, 2], [2, 2], [0, 1], False, False, 5)
case(aten.avg_pool3d.default, randn(2, 2, 6, 6, 5), [2, 2, 2])
case(aten.adaptive_avg_pool2d.default, randn(2, 2, 8, 9), [4, 3])
case(aten.adaptive_avg_pool3d.default, randn(2, 2, 4, 6, 3), [2, 3, 1])
case(aten.upsample_nearest2d.vec, randn(2, 2, 5, 3), None, [2.0, 3.0])
case(aten.upsample_nearest2d.vec, randn(2, 2, 5, 3), [10, 6], None)
case(aten.upsample_nearest1d.vec, randn(2, 3, 5), [7], None)  # not an integer scale: batch/channels only
case(aten.upsample_nearest3d.vec, randn(2, 2, 3, 2, 2), None, [2.0, 2.0, 1.0])
case(aten.upsample_bilinear2d.vec, randn(2, 3, 4, 5), None, False, [2.0, 2.0], tol=1e-4)
case(aten.upsample_linear1d.vec, randn(2, 3, 5), [9], True, None, tol=1e-4)
case(aten.upsample_bicubic2d.vec, randn(2, 3, 4, 4), [6, 6], False, None, tol=1e-4)
case(aten.upsample_trilinear3d.vec, randn(2, 3, 2, 3, 2), None, False, [2.0, 1.0, 2.0], tol=1e-4)
case(aten.adaptive_avg_pool2d.default, IMG, [3, 2])
case(aten._adaptive_avg_pool2d.default, IMG, [1, 1])

# ---- normalisation, softmax, losses, embedding -------------------------------------------
case(aten.layer_norm.default, randn(6, 5, 8), [8], randn(8), randn(8))
case(aten.layer_norm.default, randn(6, 5, 8), [5, 8])
case(aten.rms_norm.default, randn(6, 5, 8), [8], randn(8))
case(aten.rms_norm.default, randn(7, 8), [8], None, 1e-6)
case(aten.group_norm.default, randn(6, 4, 5), 2, randn(4), randn(4), 1e-5, False)
case(aten._weight_norm.default, randn(6, 4, 5), pos(6, 1, 1), 0)
case(aten._weight_norm.default, randn(3, 4, 6), pos(1, 1, 6), 2)
_BN = (randn(6, 5, 4, 3), pos(5), randn(5), randn(5), pos(5))  # 5 channels: 2+2+1 on 3 devices, none empty
case(aten.batch_norm.default, *_BN, True, 0.1, 1e-5, False)
case(aten.batch_norm.default, *_BN, False, 0.1, 1e-5, False)
case(aten.batch_norm.default, randn(7, 6), None, None, None, None, True, 0.1, 1e-5, False)

case(aten.softmax.int, X, 1)
case(aten.softmax.int, X, -1, torch.float64)
case(aten._softmax.default, X, 2, False)
case(aten.log_softmax.int, X, 0)
case(aten._log_softmax.default, X, -1, False)

LOGITS, LABELS = randn(6, 5), torch.tensor([0, 4, 2, -100, 1, 3])
for _r in (0, 1, 2):  # a mean (1) splits only its classes: uneven row chunks weigh their means differently
    case(aten.cross_entropy_loss.default, LOGITS, LABELS, pos(5), _r)
    case(aten.nll_loss_forward.default, LOGITS.log_softmax(1), LABELS, pos(5), _r, -100)
    case(aten.mse_loss.default, X, randn(6, 5, 7), _r, splits=_r != 1)
case(aten.cross_entropy_loss.default, randn(4, 5, 7), ints(5, 4, 7), None, 2, -100, 0.1)
case(aten.cross_entropy_loss.default, LOGITS, LOGITS.softmax(1), None, 2)
case(aten.cross_entropy_loss.default, LOGITS, LOGITS.softmax(1), None, 0, -100, 0.2)
case(aten.cross_entropy_loss.default, randn(3, 7, 2, dtype=torch.float64), torch.tensor([[6, 0], [-100, 3], [5, 5]]),
     None, 1)  # classes split with more dims, an ignored row and a class on no 3-way member's edge
case(aten.cross_entropy_loss.default, LOGITS, LABELS.clamp(0), None, 1, 2)  # another ignore_index
case(aten.nll_loss.default, LOGITS, LABELS, None, 2)
case(aten.nll_loss.default, LOGITS, LABELS, pos(5), 1)
case(aten.nll_loss_nd.default, randn(4, 5, 7), ints(5, 4, 7), pos(5), 0)
case(aten.nll_loss_nd.default, randn(4, 5, 7), ints(5, 4, 7), None, 1)
case(aten.nll_loss2d_forward.default, randn(2, 5, 3, 7), ints(5, 2, 3, 7), None, 2, -100)

case(aten.embedding.default, randn(10, 6), ints(10, 5, 7))
case(aten.embedding.default, randn(10, 6), ints(10, 7), 0)

# ---- reductions --------------------------------------------------------------------------
case(aten.linalg_vector_norm.default, X, 2, [-1], True)
case(aten.logsumexp.default, X, [1])
case(aten.logsumexp.default, X, [-1], True)
case(aten.linalg_vector_norm.default, X, 2.0, [0, 2])
case(aten.sum.default, X)
case(aten.sum.default, ints(5, 6, 7), splits=False)  # integers are never P, and all dims are reduced
case(aten.sum.default, X, dtype=torch.float64)
case(aten.sum.dim_IntList, X, [1])
case(aten.sum.dim_IntList, X, [0, -1], True)
case(aten.sum.dim_IntList, X, None)
case(aten.mean.default, X)
case(aten.mean.dim, X, [-1])
case(aten.mean.dim, X, [0, 1], True)
case(aten.amax.default, X, [1], True)
case(aten.amax.default, X, splits=False)  # over every dim: no placement for a pending max
case(aten.amin.default, X, [0, 2])
case(aten.max.dim, X, 1)
case(aten.min.dim, X, 0, True)
case(aten.argmax.default, X, 1)
case(aten.argmax.default, X, splits=False)  # an index into the flattened tensor
case(aten.argmin.default, X, -1, True)
case(aten.var.correction, X, [1], correction=1)
case(aten.var.dim, X, [0], True, True)
case(aten.std.correction, X, [1], correction=0, keepdim=True)
case(aten.var.correction, X, None, splits=False)  # over every dim: not linear
case(aten.std.dim, X, [2])
case(aten.cumsum.default, X, 1)
case(aten.topk.default, X, 2)
case(aten.scatter.value, randn(6, 8), 1, ints(8, 6, 3), 0.0)  # a router's mask: rows split
case(aten.scatter.src, randn(6, 8), 1, ints(8, 6, 3), randn(6, 3))
case(aten.scatter.value, randn(6, 8), 0, ints(6, 6, 8), 1.0)
case(aten.topk.default, X, 3, 0, False)
case(aten.sort.default, X, 1)
case(aten.sort.stable, X, stable=True, dim=0, descending=True)
case(aten.diff.default, X, 1, 1)
case(aten.one_hot.default, ints(5, 6, 7), 5)
case(aten.any.default, mask(6, 5), splits=False)  # over every dim: REPLICATE_ONLY
case(aten.any.dim, mask(6, 5, 7), 1)
case(aten.any.dims, mask(6, 5, 7), [0, 2], True)
case(aten.all.default, mask(6, 5), splits=False)
case(aten.max.default, X, splits=False)  # over every element: REPLICATE_ONLY
case(aten.min.default, X, splits=False)
case(aten._assert_async.msg, torch.tensor(True), "holds", splits=False)
case(aten._assert_async.default, torch.tensor(True), splits=False)
case(aten.all.dim, mask(6, 5, 7), -1)
case(aten.flip.default, X, [1])
case(aten.flip.default, X, [0, -1])
case(aten.as_strided.default, randn(6, 8), [3, 4, 4], [8, 2, 1], splits=False)  # REPLICATE_ONLY: any elements
case(aten.diff.default, ints(9, 5, 7), 1, -1, ints(9, 5, 1))  # integer (no P): dim 0 splits 2+2+1 on 3
case(aten.diff.default, X, 2, 0, randn(2, 5, 7), randn(1, 5, 7))

# ---- gathers by index and padding ----------------------------------------------------------
case(aten.index.Tensor, randn(6, 7), [ints(6, 6, 1, 1, 1), ints(7, 1, 1, 5, 1)])  # HF mask pattern
case(aten.index.Tensor, ints(9, 6, 7), [ints(6, 6, 1, 1), ints(7, 1, 5, 3)])
case(aten.index.Tensor, X, [None, ints(5, 4, 3)])
case(aten.index.Tensor, X, [ints(6, 4), None, ints(7, 4)])
case(aten.index.Tensor, X, [ints(6, 3, 1), ints(5, 3, 4)])
case(aten.gather.default, X, 1, ints(5, 6, 3, 7))
case(aten.gather.default, X, 0, ints(6, 4, 5, 2))
case(aten.gather.default, ints(3, 1, 12), 1, ints(12, 1, 7))
case(aten.index_select.default, X, 1, ints(5, 4))
case(aten.index_select.default, randn(6, 5), 0, ints(6, 7))
case(aten.pad.default, ints(9, 6, 7), [0, 1], "constant", -100.0)
case(aten.pad.default, X, [1, 1], "constant", 0.0)
case(aten.pad.default, X, [1, 2, 0, 0], "reflect")
case(aten.pad.default, X, [1, 1], "replicate")
case(aten.pad.default, X, [0, 0, 1, 1], "circular")
case(aten.constant_pad_nd.default, X, [0, 0, 2, 1])
case(aten.constant_pad_nd.default, X, [1, 0], 1.5)
case(aten.constant_pad_nd.default, randn(3, 9, 5), [0, 0, -2, 1])  # crops 2 rows before, pads 1 after

# ---- data-dependent sizes (tests/test_datadep.py checks them on 1, 2 and 4 devices) ----------------------------
_M = mask(6)
_M[0] = True
case(aten.index.Tensor, X, [_M])  # a boolean mask: the dims it does not cover split
case(aten.index_put.default, X, [_M], randn(int(_M.sum()), 5, 7))
case(aten.index_put.default, X, [ints(6, 4)], randn(4, 5, 7), True)
case(aten.index_add.default, randn(6, 5), 0, ints(6, 9), randn(9, 5))
case(aten.sym_size.int, X, 1)
case(aten.div.Tensor_mode, X, pos(5, 7), rounding_mode="floor")
case(aten.div.Scalar_mode, X, 2.0, rounding_mode="trunc")
case(aten.remainder.Scalar, ints(9, 6, 5), 4)
case(aten.remainder.Tensor, ints(9, 6, 5), ints(3, 5) + 1)
for _op, _args in ((aten.masked_select.default, (X, X > 0.3)), (aten.nonzero.default, (_M,)),
                   (aten.argwhere.default, (_M,)), (aten._unique2.default, (ints(4, 9),)),
                   (aten.unique_dim.default, (ints(3, 6, 4), 0)), (aten.unique_consecutive.default, (ints(3, 9),)),
                   (aten.repeat_interleave.Tensor, (ints(4, 5),)), (aten.bincount.default, (ints(5, 9),)),
                   (aten.item.default, (randn(1),)), (aten._local_scalar_dense.default, (ints(9, 1),))):
    case(_op, *_args, splits=False)  # values in, a data-dependent number out: replicated
case(aten.pad.default, randn(2, 7, 6), [2, 1, 1, 3], "constant", -1.0)

# ---- views and data movement -------------------------------------------------------------
V3 = randn(4, 6, 5)
case(aten.view.default, V3, [4, 30])
case(aten.view.default, V3, [-1, 5])
case(aten.view.default, randn(12, 5), [3, 4, 5])
case(aten.view.default, randn(12, 5), [2, 6, 5])
case(aten.view.default, randn(6, 1, 7), [6, 7, 1])
case(aten.view.default, randn(6, 4), [4, 6])
case(aten.reshape.default, V3, [-1])
case(aten.reshape.default, V3, [2, 2, 6, 5])
case(aten._unsafe_view.default, V3, [24, 5])
case(aten.view_as.default, V3, randn(4, 30))
case(aten.flatten.using_ints, V3, 1, 2)
case(aten.flatten.using_ints, V3, 0, 1)
case(aten.unflatten.int, randn(4, 30), 1, [6, -1])
case(aten.unflatten.int, randn(30, 7), 0, [-1, 5])
case(aten.permute.default, X, [2, 0, 1])
case(aten.transpose.int, X, 0, -1)
case(aten.t.default, randn(6, 5))
case(aten.t.default, randn(7))
case(aten.unsqueeze.default, X, 1)
case(aten.unsqueeze.default, X, -1)
case(aten.squeeze.dim, randn(6, 1, 5), 1)
case(aten.squeeze.dim, randn(3, 5), 0)
case(aten.squeeze.dims, randn(6, 1, 5, 1), [1, 3])
case(aten.squeeze.default, randn(6, 1, 5))
case(aten.expand.default, randn(5, 1), [4, -1, 6])
case(aten.expand.default, randn(6, 5), [6, 5])
case(aten.expand_as.default, randn(5, 1), randn(4, 5, 6))
case(aten.slice.Tensor, X, 1, 1, 4)
case(aten.slice.Tensor, X, 0, 0, 9223372036854775807)
case(aten.slice.Tensor, X, -1, None, None, 2)
case(aten.narrow.default, X, 2, 1, 3)
case(aten.select.int, X, 1, 2)
case(aten.select.int, X, -1, 0)
case(aten.cat.default, [X, randn(6, 3, 7)], 1)
case(aten.cat.default, [randn(5, 7), randn(2, 7), randn(1, 7)])
case(aten.concatenate.default, [X, randn(6, 3, 7)], 1)  # cat's other name (Zamba2)
case(aten.cat.default, [ints(5, 5, 6), ints(5, 5, 6)], -1)
case(aten.stack.default, [X, randn(6, 5, 7)], 1)
case(aten.stack.default, [randn(5, 7), randn(5, 7)], -1)
case(aten.split.Tensor, X, 2, 1)
case(aten.split_with_sizes.default, X, [2, 3], 1)
case(aten.chunk.default, X, 3, -1)
case(aten.tensor_split.indices, X, [1, 4], 1)  # Qwen 3.5 (transformers 5.25)
case(aten.tensor_split.indices, X, [2, 2, 9], -1)  # an empty piece and one past the end
case(aten.tensor_split.sections, X, 4, 0)  # uneven: 6 rows in 4 sections
case(aten.unbind.int, X, 1)
case(aten.reshape_as.default, V3, randn(4, 30))
case(aten.numpy_T.default, X)
case(aten.broadcast_to.default, randn(5, 1), [4, 5, 6])
case(aten.slice_scatter.default, X, randn(6, 3, 7), 1, 1, 4)
case(aten.slice_scatter.default, X, randn(6, 5, 3), -1, 0, None, 3)
case(aten.select_scatter.default, X, randn(6, 7), 1, 2)
case(aten.select_scatter.default, X, randn(5, 7), 0, -1)
# repetition (a tiled tensor and interleaved elements, as rotary tables are built)
case(aten.repeat.default, randn(3, 5), [4, 1, 2])  # a new dim split 4 ways, dim 1 kept, dim 2 repeated
case(aten.repeat.default, randn(6, 5), [1, 2])
case(aten.repeat.default, randn(6, 5), [2, 1])  # 2 copies of 6 rows: whole copies only on 2 devices
case(aten.repeat_interleave.self_int, randn(6, 4, 5), 2, 1)
case(aten.repeat_interleave.self_int, randn(5, 4), 3, -1, output_size=12)
case(aten.repeat_interleave.self_int, randn(6, 5), 2)  # flattened first: only P
# complex views (rotary embeddings by complex multiplication)
case(aten.view_as_complex.default, randn(6, 5, 2))
case(aten.view_as_real.default, torch.view_as_complex(randn(6, 5, 2)))

# ---- factories and masks -----------------------------------------------------------------
case(aten.zeros.default, [6, 5])
case(aten.zeros.default, [7], dtype=torch.int64)
case(aten.ones.default, [6, 7])
case(aten.full.default, [5, 6], 0.0)
case(aten.full.default, [5, 6], 2.5)
case(aten.empty.memory_format, [0, 6])  # a KV cache's start: no values, any tiling
case(aten.empty.memory_format, [6, 0])
case(aten.lift_fresh_copy.default, randn(6, 5))
case(aten.detach_.default, randn(6, 5))
case(aten.new_zeros.default, randn(5, 3), [6, 5])
case(aten.new_ones.default, ints(4, 5), [7, 2])
case(aten.new_full.default, randn(3), [4, 6], 3.0)
case(aten.new_empty.default, randn(3), [4, 0])  # uninitialised values: checked on an empty tensor
case(aten.zeros_like.default, X)
case(aten.ones_like.default, X)
case(aten.full_like.default, ints(9, 5, 6), 2)
case(aten.arange.default, 10, splits=False)  # REPLICATE_ONLY, below
case(aten.arange.start, 2, 9, splits=False)
case(aten.arange.start_step, 0, 10, 3, splits=False)
case(aten.tril.default, randn(5, 6, 6))
case(aten.triu.default, randn(3, 5, 6, 7), 1)

# Ops whose rule deliberately lists nothing but all-R (see their family docstrings).
REPLICATE_ONLY = {"aten.arange.default", "aten.arange.start", "aten.arange.start_step",
                  *(f"aten.{n}" for n in ("masked_select.default", "nonzero.default", "argwhere.default",
                                          "_unique2.default", "unique_dim.default", "unique_consecutive.default",
                                          "repeat_interleave.Tensor", "bincount.default", "item.default",
                                          "_local_scalar_dense.default", "as_strided.default", "any.default",
                                          "all.default", "max.default", "min.default", "_assert_async.msg",
                                          "_assert_async.default"))}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops: intra-op threads only add overhead (100x on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _id(c: Case, i: int) -> str:
    return f"{i}-{c.name.removeprefix('aten.')}"


# A case whose only strategy is all-R checks nothing: every device runs the serial op.  So a
# splitting case must check more than that one on every mesh (its shapes are chosen so that no
# split leaves a device an empty tile), and the cases where the rule rightly lists no split
# (means, reductions over every dim, integer sums, arange) are a test of their own, which fails
# when the rule starts splitting them: then they move here.
SPLIT = [(i, c) for i, c in enumerate(CASES) if c.splits]
UNSPLIT = [(i, c) for i, c in enumerate(CASES) if not c.splits]


def test_chunk_lengths_are_the_lengths_of_the_chunks() -> None:
    """``tiling.chunk_lengths`` (which ``has_empty_tile`` reads) is the set of ``chunk_range``'s lengths."""
    from soybean.tiling import chunk_lengths, chunk_range

    for n in range(0, 70):
        for p in range(1, 40):
            assert chunk_lengths(n, p) == {b - a for a, b in (chunk_range(n, p, k) for k in range(p))}, (n, p)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("c", [c for _, c in SPLIT], ids=[_id(c, i) for i, c in SPLIT])
def test_rule_is_exact(c: Case, mesh: Mesh) -> None:
    """Every strategy the rule allows is exact on ``mesh``, and some allowed strategy splits."""
    checked = check_op(c.target, c.args, c.kwargs, mesh, rtol=c.tol, atol=c.tol)
    assert checked > 1, f"{c.name}: only the all-R strategy on mesh {mesh}: nothing was split"


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("c", [c for _, c in UNSPLIT], ids=[_id(c, i) for i, c in UNSPLIT])
def test_unsplit_case_allows_only_all_replicated(c: Case, mesh: Mesh) -> None:
    """For these arguments the rule lists nothing: all-R (run and checked) is the one strategy."""
    assert check_op(c.target, c.args, c.kwargs, mesh, rtol=c.tol, atol=c.tol) == 1


def test_every_registered_rule_has_a_case() -> None:
    missing = sorted(set(REGISTRY) - {c.name for c in CASES})
    assert not missing, f"rules without a validation case: {missing}"


def test_every_rule_splits_somewhere() -> None:
    """Each registered op has a case where some non-trivial strategy survives on some mesh."""
    best: dict[str, int] = {}
    for c in CASES:
        op = c.opspec()
        best[c.name] = max(best.get(c.name, 0), *(len(expand(op, m)) for m in MESHES))
    idle = sorted(n for n in REGISTRY if best.get(n, 0) <= 1 and n not in REPLICATE_ONLY)
    assert not idle, f"rules never exercised beyond all-R: {idle}"


def test_every_listed_strategy_is_validated() -> None:
    """No one-axis strategy a rule lists for a case escapes validation on all three meshes."""
    unchecked = []
    for c in CASES:
        op = c.opspec()
        seen = {
            (tuple(t[a] for t in st.inputs), tuple(t[a] for t in st.outputs))
            for m in MESHES for st in expand(op, m) for a in range(m.ndim)
        }
        unchecked += [f"{c.name}: {s}" for s in strategies_1d(op) if (s.inputs, s.outputs) not in seen]
    assert not unchecked, "\n".join(unchecked)


def test_rules_never_list_replicate_or_integer_partial() -> None:
    for c in CASES:
        op = c.opspec()
        listed = REGISTRY[c.name].fn(op)
        assert not any(s.redundant for s in listed), f"{c.name} lists the all-R strategy"
        specs = op.inputs + op.outputs
        for s in strategies_1d(op):
            for spec, pl in zip(specs, s.inputs + s.outputs):
                assert not (isinstance(pl, Partial) and not (spec.dtype.is_floating_point or spec.dtype.is_complex)), (
                    f"{c.name}: P on a {spec.dtype} tensor in {s}")


# ---- routed experts (mixture of experts) ---------------------------------------------------------
# A body per expert ``e`` of ``silu(row * v_e)`` (``ir.experts``' JSON): rows gathered per expert, no grouped matmul.
_BODY = ('{"steps":[["aten::index.Tensor",[{"ref":3},[{"ref":2}]],{}],["aten::mul.Tensor",[{"ref":0},{"ref":4}],{}],'
         '["aten::silu.default",[{"ref":5}],{}]],"out":{"ref":6},"offs_dtype":"int32"}')
case(ROUTED_EXPERTS, randn(7, 5), ints(3, 7, 2), pos(7, 2), [randn(3, 5)], 3, _BODY, tol=1e-4)


# ---- the validator must be able to fail ----------------------------------------------------
def _fixed(*strategies: Strategy1D) -> Callable[[OpSpec], list[Strategy1D]]:
    return lambda op: list(strategies)


WRONG: list[tuple[str, Any, tuple, Callable[[OpSpec], list[Strategy1D]], Mesh]] = [
    # relu is not linear: relu(P) != P
    ("relu(P)->P", aten.relu.default, (X,), _fixed(Strategy1D((P,), (P,))), Mesh((2,))),
    # add(P, R) adds the replicated operand once per device
    ("add(P,R)->P", aten.add.Tensor, (X, randn(6, 5, 7)), _fixed(Strategy1D((P, R), (P,))), Mesh((2,))),
    # shards of the two free indices do not make a row shard
    ("mm(S0,S1)->S0", aten.mm.default, (randn(6, 7), randn(7, 4)), _fixed(Strategy1D((S(0), S(1)), (S(0),))), Mesh((2,))),
    # softmax over the sharded dim normalises each chunk separately
    ("softmax on its dim", aten.softmax.int, (X, 1), _fixed(Strategy1D((S(1),), (S(1),))), Mesh((2,))),
    # the sum of local means is p times the mean
    ("mean(S)->P", aten.mean.dim, (X, [1]), _fixed(Strategy1D((S(1),), (P,))), Mesh((2,))),
    # merging: the inner dim of a merged group is not a chunk of the merged dim
    ("view inner dim", aten.view.default, (randn(4, 6), [24]), _fixed(Strategy1D((S(1),), (S(0),))), Mesh((2,))),
    # merging an uneven outer dim without the `even` mark: rows 3 + 2 are not chunks 8 + 7 of the flat dim
    ("flatten uneven", aten.flatten.using_ints, (randn(5, 3), 0, 1), _fixed(Strategy1D((S(0),), (S(0),))), Mesh((2,))),
    # batch-norm training statistics depend on the whole batch
    ("batch_norm batch split", aten.batch_norm.default, _BN + (True, 0.1, 1e-5, False),
     _fixed(Strategy1D((S(0), R, R, R, R), (S(0),))), Mesh((3,))),
    # cross-entropy mean over uneven chunks
    ("cross_entropy mean", aten.cross_entropy_loss.default, (randn(5, 4), ints(4, 5)),
     _fixed(Strategy1D((S(0), S(0)), (P,))), Mesh((3,))),
    # the index holds global row numbers: a device's rows of self are not the rows it is asked for
    ("index on an indexed dim", aten.index.Tensor, (randn(6, 7), [ints(3, 4)]), _fixed(Strategy1D((S(0), R), (S(0),))), Mesh((2,))),
    # gather reads self at the output's own position off `dim`: a shorter index misaligns the chunks
    ("gather shorter index", aten.gather.default, (randn(6, 5), 1, ints(5, 4, 5)), _fixed(Strategy1D((S(0), S(0)), (S(0),))), Mesh((2,))),
    # padding each chunk pads inside the tensor
    ("pad on its padded dim", aten.pad.default, (randn(6, 5), [1, 1]), _fixed(Strategy1D((S(1),), (S(1),))), Mesh((2,))),
    # a nonzero pad value would be added once per summand
    ("pad value on P", aten.constant_pad_nd.default, (randn(6, 5), [1, 1], 1.5), _fixed(Strategy1D((P,), (P,))), Mesh((2,))),
]


@pytest.mark.parametrize("name,target,args,rule,mesh", WRONG, ids=[w[0] for w in WRONG])
def test_validator_rejects_wrong_strategy(monkeypatch: pytest.MonkeyPatch, name: str, target: Any, args: tuple,
                                          rule: Callable[[OpSpec], list[Strategy1D]], mesh: Mesh) -> None:
    entry = REGISTRY[op_name(target)]
    monkeypatch.setitem(REGISTRY, op_name(target), RuleEntry(rule, entry.localize, entry.family))
    with pytest.raises(AssertionError, match="strategy"):
        check_op(target, args, {}, mesh)


def test_validator_rejects_missing_localize(monkeypatch: pytest.MonkeyPatch) -> None:
    """A view sharded without rewriting its size argument fails (here: a size mismatch)."""
    name = "aten.view.default"
    monkeypatch.setitem(REGISTRY, name, RuleEntry(REGISTRY[name].fn, None, "views"))
    with pytest.raises((AssertionError, RuntimeError)):
        check_op(aten.view.default, (randn(4, 6), [4, 2, 3]), {}, Mesh((2,)))


# ---- spatial splits with halos (rules.window) ------------------------------------------------
SPATIAL = [c for c in CASES if REGISTRY[c.name].windows is not None and REGISTRY[c.name].windows(c.opspec())]


@pytest.mark.parametrize("mesh", [Mesh((4,)), Mesh((2, 2))], ids=str)
@pytest.mark.parametrize("c", SPATIAL, ids=lambda c: c.name)
def test_spatial_split_is_exact(c: Case, mesh: Mesh) -> None:
    """Every windowed op whose case has a window splits a spatial dim on ``mesh`` (4 members: tiles thinner
    than the halo), and every strategy is exact."""
    op = c.opspec()
    wins = REGISTRY[c.name].windows(op)
    spatial = [st for st in expand(op, mesh) if any(S(w.dim) in st.inputs[w.slot] for w in wins)]
    line = Mesh((max(mesh.shape),))  # some tile empty on every axis: no split offered (has_empty_tile)
    empty = all(has_empty_tile((S(0),), (w.n_out,), line) or has_empty_tile((S(0),), (w.n_in,), line) for w in wins)
    assert spatial or empty, f"{c.name}: no spatial strategy on {mesh}"
    check_op(c.target, c.args, c.kwargs, mesh, rtol=c.tol, atol=c.tol)


def test_spatial_cases_cover_every_window_kind() -> None:
    kinds = {w.kind for c in SPATIAL for w in REGISTRY[c.name].windows(c.opspec())}
    assert kinds == {"conv", "transposed", "nearest"}


def _halo_case() -> tuple[Any, tuple]:
    return aten.conv2d.default, (randn(1, 2, 9, 7), randn(3, 2, 3, 3), None, [2, 1], [1, 2], [1, 2])


def test_validator_rejects_window_without_its_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conv run on a window of rows with its padding left on pads inside the tensor: wrong."""
    target, args = _halo_case()
    e = REGISTRY[op_name(target)]
    keep = lambda op, a, k, split: (a, k)  # noqa: E731
    monkeypatch.setitem(REGISTRY, op_name(target), RuleEntry(e.fn, e.localize, e.family, e.cost, e.windows, keep))
    with pytest.raises((AssertionError, RuntimeError)):
        check_op(target, args, {}, Mesh((2,)))


def test_validator_rejects_a_short_halo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows one row short of the kernel's extent read too few neighbour rows: wrong."""
    from dataclasses import replace

    target, args = _halo_case()
    e = REGISTRY[op_name(target)]
    short = lambda op: [replace(w, extent=w.extent - 1) for w in e.windows(op)]  # noqa: E731

    def args_fixed(op: OpSpec, a: tuple, k: dict, split: Any) -> tuple:
        a, k = e.window_args(op, a, k, split)
        return a, k

    monkeypatch.setitem(REGISTRY, op_name(target), RuleEntry(e.fn, e.localize, e.family, e.cost, short, args_fixed))
    with pytest.raises((AssertionError, RuntimeError)):
        check_op(target, args, {}, Mesh((2,)))


def test_a_scalar_that_overflows_summands_keeps_its_operand_whole() -> None:
    """``x * finfo.min`` (BERT-style masks) and ``x / 1e-37`` list no pending sum: its summands would overflow where
    the sum does not (NaN); a moderate scalar keeps ``P``, and so does a tensor factor."""
    def partial(target: Any, *args: Any) -> bool:
        op = make_opspec(target, args, {}, target(*args))
        return any(isinstance(p, Partial) for s in strategies_1d(op) for p in s.inputs)

    x = X.float()
    assert not partial(aten.mul.Tensor, x, torch.finfo(torch.float32).min)
    assert not partial(aten.mul.Tensor, x, float("inf"))
    assert not partial(aten.div.Tensor, x, 1e-37)
    assert not partial(aten.div.Tensor, x, 0.0)
    assert partial(aten.mul.Tensor, x, -1e9) and partial(aten.div.Tensor, x, 8.0)
    assert partial(aten.mul.Tensor, x, x)
