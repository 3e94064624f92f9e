"""``drop_assertions``: runtime metadata assertions (``_assert_tensor_metadata``: no output, no effect on values) are
erased, and so is a tensor set to itself (``set_(x, x)``), and an in-place write nothing reads into a tensor forward
made (``dead_write``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .common import aten, noop_set, unset

ASSERTIONS = (aten._assert_tensor_metadata.default,)
# Ops that make a fresh tensor from nothing but sizes (no tensor argument): what a dead write may be into.
FRESH = (aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default,
         aten.empty_strided.default)
# Through these a write reaches the same storage (the dead chain is erased with the write).
THROUGH = (aten.detach.default, aten.alias.default)


def drop_assertions(gm: fx.GraphModule) -> None:
    """Erase runtime metadata assertions: they return nothing and check what capture already fixed.  Also a
    tensor set to itself, ``set_(x, x)``: what ``module.to(its own dtype)`` leaves of ``p.data = p.to(dtype)``
    (Switch Transformers' router casts its classifier on every call); it changes nothing, and run on a parameter
    that requires a gradient it would raise.  And every ``dead_write``, with the tensor it wrote."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in ASSERTIONS and not n.users:
            gm.graph.erase_node(n)
        elif noop_set(n):
            unset(gm.graph, n)
        elif (chain := dead_write(n)) is not None:
            for d in chain:
                gm.graph.erase_node(d)


def dead_write(n: fx.Node) -> list[fx.Node] | None:
    """``n`` and the tensor it writes (users first), where ``n`` writes in place (a mutable schema: ``uniform_``,
    ``fill_``...) into a tensor forward made from sizes alone (``FRESH``, through ``THROUGH``) and nothing reads
    either: BigBird-Pegasus's encoder builds an ``nn.Linear`` in forward that it never calls, so its weight's
    ``kaiming_uniform_`` ran as a random op without a rule.  Erasing it changes no value the graph computes; a
    write into anything else (a parameter, a buffer, an input) is state and is kept.  None: not such a write."""
    if n.op != "call_function" or n.users or not isinstance(n.target, torch._ops.OpOverload):
        return None
    if not n.target._schema.is_mutable or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    chain: list[fx.Node] = [n]
    t: Any = n.args[0]
    while isinstance(t, fx.Node) and t.op == "call_function" and len(t.users) == 1:
        chain.append(t)
        if t.target in FRESH:
            return chain
        if t.target not in THROUGH:
            return None
        t = t.args[0]
    return None
