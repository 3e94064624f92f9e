"""``inline_grad_regions``: grad-mode regions that ``torch.export`` wraps in a higher-order op (a ``torch.no_grad()``
block, such as Llama's rotary embedding) are inlined, with their outputs detached, so every remaining node is a plain
aten op."""
from __future__ import annotations

import torch
from torch import fx

from .common import aten, call, unset


def inline_grad_regions(gm: fx.GraphModule) -> None:
    """Inline every ``wrap_with_set_grad_enabled(enabled, submod, *args)`` region into the graph.

    ``torch.export`` keeps a ``torch.no_grad()`` block as a call of a submodule.  Its nodes are
    copied in place of the call (their ``meta['val']`` included); a no-grad region's floating-point
    outputs go through ``aten.detach``, so values and gradients are exactly those of the model.
    Nested regions are inlined too (the loop runs until none is left).
    """
    g = gm.graph
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    while True:
        calls = [n for n in g.nodes if n.op == "call_function" and n.target is hop]
        if not calls:
            break
        for n in calls:
            enabled, sub, *args = n.args
            body = getattr(gm, sub.target)
            env = dict(zip([p for p in body.graph.nodes if p.op == "placeholder"], args, strict=True))
            with g.inserting_before(n):
                result = g.graph_copy(body.graph, env)
                outs = list(result) if isinstance(result, (tuple, list)) else [result]
                # ``module.to(its own dtype)`` inside ``no_grad`` (Switch Transformers' router casts its classifier on
                # every call): ``p.set_(p.to(dtype))`` changes nothing, and the parameter read after it is the
                # parameter itself, whose gradient must flow (detaching it would lose the classifier's gradient).
                outs = [unset(g, o) if isinstance(o, fx.Node) else o for o in outs]
                if not enabled:
                    # (a value the region only passes through is not made in it: it keeps its gradient)
                    outs = [call(g, aten.detach.default, (o,), like=n)
                            if isinstance(o, fx.Node) and _is_float(o) and o not in args else o for o in outs]
            for user in list(n.users):  # getitem(call, i)
                user.replace_all_uses_with(outs[user.args[1]])
                g.erase_node(user)
            g.erase_node(n)
            if not sub.users:
                g.erase_node(sub)
                delattr(gm, sub.target)
    g.lint()


def _is_float(n: fx.Node) -> bool:
    """Does the node produce a floating-point tensor?"""
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point()
