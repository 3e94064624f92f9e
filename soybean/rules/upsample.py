"""Upsampling (``interpolate``): nearest, bilinear/bicubic/trilinear/linear, ``.vec`` overloads.

Each output plane is computed from its own input plane, so every dim before the spatial ones
(batch, channels) may be sharded on input and output, and the op is linear (``P`` -> ``P``).

Nearest with an integer scale ``r`` (output length ``r n``) is windowed (``rules.window``, kind
``nearest``): output row ``o`` is input row ``floor(o / r)``, so a member reads rows
``[floor(a / r), floor((b - 1) / r) + 1)`` and keeps its rows of their upsampling.  Non-integer
scales and the interpolating modes weigh rows by positions relative to the whole length: their
spatial dims are not split.
"""
from __future__ import annotations

from collections.abc import Sequence

from ._common import Args, Shard, partial_strategies, set_arg
from .base import ELEMENTWISE, OpSpec, Strategy1D, register
from .window import Window

# op -> spatial rank
TABLE: dict[str, int] = {
    "aten.upsample_nearest1d.vec": 1,
    "aten.upsample_nearest2d.vec": 2,
    "aten.upsample_nearest3d.vec": 3,
    "aten.upsample_linear1d.vec": 1,
    "aten.upsample_bilinear2d.vec": 2,
    "aten.upsample_bicubic2d.vec": 2,
    "aten.upsample_trilinear3d.vec": 3,
}


def upsample_windows(op: OpSpec) -> list[Window]:
    if "nearest" not in op.name:
        return []
    a = Args(op)
    x, out = a.tensor("input"), op.outputs[0]
    rank = TABLE[op.name]
    first = x.ndim - rank
    scales = a["scale_factors"]
    found = []
    for i in range(rank):
        n, m = x.shape[first + i], out.shape[first + i]
        if n == 0 or m % n:
            continue
        r = m // n
        if scales is not None and float(scales[i]) != float(r):  # torch maps rows by 1 / scale
            continue
        found.append(Window(a.idx("input"), first + i, n, m, "nearest", r))
    return found


def upsample_window_args(op: OpSpec, args: tuple, kwargs: dict, split: Sequence[tuple[Window, int]]) -> tuple:
    """On windows of rows: an explicit output size becomes the local one (``r`` times the rows)."""
    a = Args(op)
    if a["output_size"] is None:
        return args, kwargs
    rank = TABLE[op.name]
    first = a.tensor("input").ndim - rank
    rows = {w.dim: w.local_out(0, n) for w, n in split}
    size = [rows.get(first + i, int(m)) for i, m in enumerate(a["output_size"])]
    return set_arg(op, args, kwargs, "output_size", size)


@register(*TABLE, family="upsample", cost=ELEMENTWISE, windows=upsample_windows, window_args=upsample_window_args)
def upsample(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("input")
    found = [a.strategy({"input": Shard(d)}, Shard(d)) for d in range(x.ndim - TABLE[op.name])]
    found += [a.strategy({"input": Shard(w.dim)}, Shard(w.dim)) for w in upsample_windows(op)]
    return found + partial_strategies(a, [["input"]])
