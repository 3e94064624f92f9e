"""``squeeze_dims``: ``x.squeeze()`` (``aten.squeeze.default``, every size-1 dim removed) becomes
``aten.squeeze.dims(x, removed)``, the dims the example has of size 1 named.

Why: on a tile, ``squeeze()`` removes whatever dims the tile has of size 1, which is not the serial op's when a split
dim's tile is one row wide, so its rule could split no dim at all; a weight of shape (1, 64) a router squeezes (ERNIE
4.5 MoE's score correction bias) could then be neither split nor stored split, and every tensor-parallel baseline
that stores 2-D weights split was infeasible.  Naming the dims makes the op the same on every tile; its rule splits
the dims it keeps.  Exact for static shapes; a node whose input has a symbolic size is left as it is."""
from __future__ import annotations

import torch
from torch import fx

from .common import aten


def squeeze_dims(gm: fx.GraphModule) -> None:
    """Rewrite every ``aten.squeeze.default`` whose input's shape is known into ``aten.squeeze.dims``."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.squeeze.default:
            continue
        x = n.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
            continue
        n.target = aten.squeeze.dims
        n.args = (x, [d for d, s in enumerate(val.shape) if s == 1])
        n.kwargs = {}
