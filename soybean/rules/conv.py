"""Convolutions (``conv1d``/``conv2d``/``conv3d``, int or string padding) and transposed convolutions.

``out[n, o, *] = bias[o] + sum_{c, taps} w[o, c, taps] * x[n, c, * + taps]``
with input ``(N, C, *spatial)`` (or unbatched ``(C, *spatial)``) and weight
``(O, C / groups, *kernel)``; a transposed convolution is its adjoint in ``x``, weight
``(C, O / groups, *kernel)``.  Exact one-axis strategies:

* batch: input ``S(0)``, out ``S(0)``; weight and bias ``R``;
* out channels (``groups == 1``): weight ``S(0)`` (transposed: ``S(1)``), bias ``S(0)``, out ``S(c)``;
* in channels (contracted, ``groups == 1``): input ``S(c)``, weight ``S(1)`` (transposed: ``S(0)``),
  bias ``P``, out ``P``;
* linear in input or in weight: that one ``P``, the other ``R``, bias ``P`` -> ``P``;
* spatial (domain parallelism): input ``S(d)``, out ``S(d)``, weight and bias ``R``; each member
  reads its output rows' window of input rows (``rules.window``: ``conv`` with stride ``t``,
  padding ``q``, extent ``dilation (k - 1) + 1``; ``transposed`` for the transposed ones), the
  neighbours' rows by the halo exchange, and runs the op with that dim's padding 0.  Not for
  string padding ``"same"`` (its split of the padding may be asymmetric).

Grouped convolutions keep their channels whole (a chunk of channels is not a whole number of
groups in general).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._common import Args, P, R, Shard, partial_strategies, set_arg
from .base import OpCost, OpSpec, Strategy1D, register
from .window import Window, spatial_list

CONVS = tuple(f"aten.conv{k}d.{o}" for k in (1, 2, 3) for o in ("default", "padding"))
TRANSPOSED = ("aten.conv_transpose1d.default", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input")


def conv_flops(op: OpSpec) -> float:
    """``2 * |out| * C_in/groups * prod(kernel)``: one multiply-add per output element and weight tap."""
    return 2.0 * math.prod(op.outputs[0].shape) * math.prod(op.inputs[1].shape[1:])


def transposed_flops(op: OpSpec) -> float:
    """``2 * |in| * C_out/groups * prod(kernel)``: every input element meets every tap of its group."""
    return 2.0 * math.prod(op.inputs[0].shape) * math.prod(op.inputs[1].shape[1:])


def _spatial(op: OpSpec) -> tuple[Args, int, int]:
    """The op's arguments, its spatial rank ``k`` and first spatial dim."""
    a = Args(op)
    x, w = a.tensor("input"), a.tensor("weight")
    k = w.ndim - 2
    return a, k, x.ndim - k


def conv_windows(op: OpSpec) -> list[Window]:
    a, k, first = _spatial(op)
    pad = a["padding"]
    if isinstance(pad, str):
        if pad != "valid":
            return []
        pad = 0
    x, out, w = a.tensor("input"), op.outputs[0], a.tensor("weight")
    stride, padding, dil = spatial_list(a["stride"], k), spatial_list(pad, k), spatial_list(a["dilation"], k)
    return [Window(a.idx("input"), first + i, x.shape[first + i], out.shape[first + i], "conv", stride[i], padding[i],
                   dil[i] * (w.shape[2 + i] - 1) + 1) for i in range(k)]


def transposed_windows(op: OpSpec) -> list[Window]:
    a, k, first = _spatial(op)
    x, out, w = a.tensor("input"), op.outputs[0], a.tensor("weight")
    stride, padding, dil = spatial_list(a["stride"], k), spatial_list(a["padding"], k), spatial_list(a["dilation"], k)
    return [Window(a.idx("input"), first + i, x.shape[first + i], out.shape[first + i], "transposed", stride[i],
                   padding[i], dil[i] * (w.shape[2 + i] - 1) + 1) for i in range(k)]


def _zeroed(v: Any, k: int, first: int, dims: Sequence[int]) -> list[int]:
    vals = spatial_list(v, k)
    return [0 if first + i in dims else n for i, n in enumerate(vals)]


def conv_window_args(op: OpSpec, args: tuple, kwargs: dict, split: Sequence[tuple[Window, int]]) -> tuple:
    """The call on windows of rows: padding 0 (transposed: and output padding 0) along the split dims."""
    a, k, first = _spatial(op)
    dims = [w.dim for w, _ in split]
    names = ("padding", "output_padding") if "transpose" in op.name else ("padding",)
    for name in names:
        if not isinstance(a[name], str):  # string padding is "valid" here: already 0
            args, kwargs = set_arg(op, args, kwargs, name, _zeroed(a[name], k, first, dims))
    return args, kwargs


def _strategies(op: OpSpec, windows: list[Window], transposed: bool) -> list[Strategy1D]:
    a = Args(op)
    x, w = a.tensor("input"), a.tensor("weight")
    batched = x.ndim == w.ndim
    c = 1 if batched else 0
    found: list[Strategy1D] = []
    if batched:
        found.append(a.strategy({"input": Shard(0), "weight": R, "bias": R}, Shard(0)))
    if a["groups"] in (None, 1):
        o_w, i_w = (Shard(1), Shard(0)) if transposed else (Shard(0), Shard(1))
        found.append(a.strategy({"weight": o_w, "bias": Shard(0)}, Shard(c)))
        if op.outputs[0].dtype.is_floating_point:
            found.append(a.strategy({"input": Shard(c), "weight": i_w, "bias": P}, P))
    found += [a.strategy({"input": Shard(win.dim), "weight": R, "bias": R}, Shard(win.dim)) for win in windows]
    return found + partial_strategies(a, [["input", "bias"], ["weight", "bias"]])


@register(*CONVS, family="conv", cost=OpCost(flops=conv_flops, operands=(0, 1), conv=True), windows=conv_windows,
          window_args=conv_window_args)
def conv(op: OpSpec) -> list[Strategy1D]:
    return _strategies(op, conv_windows(op), transposed=False)


@register(*TRANSPOSED, family="conv", cost=OpCost(flops=transposed_flops, operands=(0, 1), conv=True),
          windows=transposed_windows, window_args=conv_window_args)
def conv_transpose(op: OpSpec) -> list[Strategy1D]:
    return _strategies(op, transposed_windows(op), transposed=True)


@register("aten.im2col.default", family="conv", cost=OpCost())
def im2col(op: OpSpec) -> list[Strategy1D]:
    """``unfold``: ``(N, C, H, W) -> (N, C * kh * kw, L)``, each block of ``kh * kw`` rows one channel's taps.
    Batch splits as it is; channels split when they split evenly into whole blocks on the output (``even`` with
    the block as the unit); the spatial dims are read through every window (not split).  Linear."""
    a = Args(op)
    x = a.tensor("self")
    taps = math.prod(a["kernel_size"])
    c = x.ndim - 3  # the channel dim (an unbatched input has none in front)
    found = [a.strategy({"self": Shard(c)}, Shard(c), [(a.idx("self"), c), (a.out_idx(), c, taps)])]
    if c == 1:
        found.append(a.strategy({"self": Shard(0)}, Shard(0)))
    return found + partial_strategies(a, [["self"]])
