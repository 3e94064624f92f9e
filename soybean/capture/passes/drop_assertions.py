"""``drop_assertions``: runtime metadata assertions (``_assert_tensor_metadata``: no output, no effect on values) are
erased, and so is a tensor set to itself (``set_(x, x)``)."""
from __future__ import annotations

from torch import fx

from .common import aten, noop_set, unset

ASSERTIONS = (aten._assert_tensor_metadata.default,)


def drop_assertions(gm: fx.GraphModule) -> None:
    """Erase runtime metadata assertions: they return nothing and check what capture already fixed.  Also a
    tensor set to itself, ``set_(x, x)``: what ``module.to(its own dtype)`` leaves of ``p.data = p.to(dtype)``
    (Switch Transformers' router casts its classifier on every call); it changes nothing, and run on a parameter
    that requires a gradient it would raise."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in ASSERTIONS and not n.users:
            gm.graph.erase_node(n)
        elif noop_set(n):
            unset(gm.graph, n)
