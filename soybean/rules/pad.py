"""Padding: ``aten.pad`` (constant, reflect, replicate, circular) and ``constant_pad_nd``.

``pad`` lists ``(before, after)`` pairs from the last dim backwards; only those dims
change, each padded from its own values (or a constant).  A dim whose pair is
``(0, 0)``, or that the list does not reach, may be sharded on input and output alike.
Linear (``P`` -> ``P``) unless a nonzero constant is added: reflect, replicate and
circular only copy elements, constant padding with 0 adds zeros.

A padded dim of a constant pad is split with a halo (``rules.window``, kind ``conv``, stride 1,
extent 1, ``q`` = the pad before; a negative pad crops): output row ``o`` is input row
``o - q`` or the constant.  Reflect, replicate and circular padding read rows whose position
depends on the whole length (the far end, for circular): not split.
"""
from __future__ import annotations

from collections.abc import Sequence

from ._common import Args, Shard, partial_strategies, set_arg
from .base import ELEMENTWISE, OpSpec, Strategy1D, register
from .window import Window


def _padded_dims(ndim: int, pad: list[int]) -> set[int]:
    return {ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}


def _constant(a: Args) -> bool:
    return a["mode"] in (None, "constant")


def pad_windows(op: OpSpec) -> list[Window]:
    a = Args(op)
    if not _constant(a):
        return []
    x, out, pad = a.tensor("self"), op.outputs[0], list(a["pad"])
    fill = float(a["value"] or 0.0)
    return [Window(a.idx("self"), d, x.shape[d], out.shape[d], "conv", 1, pad[2 * (x.ndim - 1 - d)], 1, fill)
            for d in sorted(_padded_dims(x.ndim, pad))]


def pad_window_args(op: OpSpec, args: tuple, kwargs: dict, split: Sequence[tuple[Window, int]]) -> tuple:
    """On windows of rows: no padding along the split dims (the window holds it)."""
    a = Args(op)
    ndim, pad = a.tensor("self").ndim, list(a["pad"])
    for w, _ in split:
        k = ndim - 1 - w.dim
        pad[2 * k] = pad[2 * k + 1] = 0
    return set_arg(op, args, kwargs, "pad", pad)


@register("aten.pad.default", "aten.constant_pad_nd.default", family="pad", cost=ELEMENTWISE, windows=pad_windows,
          window_args=pad_window_args)
def pad(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    padded = _padded_dims(x.ndim, list(a["pad"]))
    found = [a.strategy({"self": Shard(d)}, Shard(d)) for d in range(x.ndim) if d not in padded]
    found += [a.strategy({"self": Shard(w.dim)}, Shard(w.dim)) for w in pad_windows(op)]
    adds_constant = _constant(a) and a["value"] not in (None, 0)
    return found + ([] if adds_constant else partial_strategies(a, [["self"]]))
