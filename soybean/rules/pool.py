"""Pooling over the trailing spatial dims (max, average, adaptive).

A pool of rank ``k`` maps each ``(..., H, W)`` plane independently, so every
dim but the last ``k`` (batch, channels) may be sharded on input and outputs
(``max_pool*_with_indices``/``adaptive_max_pool2d`` indices are positions
inside a plane, unchanged by such a split).  Average pools are linear, so
``P`` -> ``P``; max pools are not.

Spatial dims (domain parallelism) are split with a halo (``rules.window``, kind ``conv``: stride,
padding, extent ``dilation (k - 1) + 1``), the window's rows outside the tensor filled as the op
pads: ``-inf`` for max, 0 for average.  Exact when the pool's value does not depend on where the
window sits: average pools need ``count_include_pad`` or no padding on that dim, and in
``ceil_mode`` no window overhanging the padded input (its divisor shrinks); max pools are exact
either way.  Adaptive pools are windowed where the input length is a multiple of the output's
(then a pool with kernel = stride = the ratio).  The ops that return indices are not split
spatially (their indices are positions in the local plane).
"""
from __future__ import annotations

from collections.abc import Sequence

from ._common import Args, Shard, partial_strategies, set_arg
from .base import ELEMENTWISE, OpSpec, Strategy1D, register
from .window import Window, spatial_list

# op -> (spatial rank, linear?)
TABLE: dict[str, tuple[int, bool]] = {
    "aten.max_pool1d.default": (1, False),
    "aten.max_pool2d.default": (2, False),
    "aten.max_pool3d.default": (3, False),
    "aten.max_pool2d_with_indices.default": (2, False),
    "aten.adaptive_max_pool2d.default": (2, False),
    "aten.avg_pool1d.default": (1, True),
    "aten.avg_pool2d.default": (2, True),
    "aten.avg_pool3d.default": (3, True),
    "aten.adaptive_avg_pool1d.default": (1, True),
    "aten.adaptive_avg_pool2d.default": (2, True),
    "aten._adaptive_avg_pool2d.default": (2, True),
    "aten.adaptive_avg_pool3d.default": (3, True),
}
WINDOWED = {"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
            "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_avg_pool3d"}


def _base(op: OpSpec) -> str:
    return op.name.split(".")[1]


def pool_windows(op: OpSpec) -> list[Window]:
    name = _base(op)
    if name not in WINDOWED:
        return []
    rank, _ = TABLE[op.name]
    a = Args(op)
    x, out = a.tensor("self"), op.outputs[0]
    first = x.ndim - rank
    n_in, n_out = x.shape[first:], out.shape[first:]
    slot = a.idx("self")
    if name.startswith("adaptive") or name.startswith("_adaptive"):
        return [Window(slot, first + i, n, m, "conv", n // m, 0, n // m)
                for i, (n, m) in enumerate(zip(n_in, n_out)) if m > 1 and n % m == 0]
    kernel = spatial_list(a["kernel_size"], rank)
    stride = spatial_list(a["stride"], rank) if a["stride"] else kernel
    pad = spatial_list(a["padding"], rank)
    dil = spatial_list(a["dilation"], rank) if name.startswith("max") else [1] * rank
    found = []
    for i in range(rank):
        ext = dil[i] * (kernel[i] - 1) + 1
        if name.startswith("avg"):
            if pad[i] and a["count_include_pad"] is False:
                continue
            if a["ceil_mode"] and (n_out[i] - 1) * stride[i] + ext > n_in[i] + 2 * pad[i]:
                continue
        fill = float("-inf") if name.startswith("max") else 0.0
        found.append(Window(slot, first + i, n_in[i], n_out[i], "conv", stride[i], pad[i], ext, fill))
    return found


def pool_window_args(op: OpSpec, args: tuple, kwargs: dict, split: Sequence[tuple[Window, int]]) -> tuple:
    """On windows of rows: padding 0 along the split dims (adaptive: the local output size there)."""
    rank, _ = TABLE[op.name]
    a = Args(op)
    first = a.tensor("self").ndim - rank
    dims = {w.dim: (w, rows) for w, rows in split}
    if "adaptive" in op.name:
        size = spatial_list(a["output_size"], rank)
        local = [dims[first + i][0].local_out(0, dims[first + i][1]) if first + i in dims else m
                 for i, m in enumerate(size)]
        return set_arg(op, args, kwargs, "output_size", local)
    pad = spatial_list(a["padding"], rank)
    if a["stride"] in (None, []):  # the default stride is the kernel: keep it when padding changes
        args, kwargs = set_arg(op, args, kwargs, "stride", spatial_list(a["kernel_size"], rank))
    return set_arg(op, args, kwargs, "padding", [0 if first + i in dims else q for i, q in enumerate(pad)])


def pool(op: OpSpec) -> list[Strategy1D]:
    rank, linear = TABLE[op.name]
    a = Args(op)
    x = a.tensor("self")
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim - rank)]
    found += [a.strategy({"self": Shard(w.dim)}, Shard(w.dim)) for w in pool_windows(op)]
    return found + (partial_strategies(a, [["self"]]) if linear else [])


register(*TABLE, family="pool", cost=ELEMENTWISE, windows=pool_windows, window_args=pool_window_args)(pool)
