"""What several capture passes share (and ``capture``, which fills and empties ``CONSTANTS``): the ``gm.meta`` key
of the tensor constants forward made, a node inserted with its meta value (``call``), and the tensors that are one
tensor through no-op casts (``aliased``, ``noop_set``, ``unset``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

# ``gm.meta`` key of the tensor constants forward made (``torch.tensor(sliding_window)``, an index list, a table):
# ``torch.export`` lifts each into a placeholder; placeholder name -> its value.  Passes may read the values
# (``fold_constant_masks`` evaluates masks built from them) and drop the ones they leave unused.
CONSTANTS = "soybean_constants"


def _meta(x: Any) -> Any:
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    return v


def call(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None,
         like: fx.Node | None = None) -> fx.Node:
    """Insert ``target(*args)`` with ``meta['val']`` computed on the meta device."""
    node = graph.call_function(target, args, kwargs or {})
    margs = tuple(_meta(a) for a in args)
    mkw = {k: _meta(v) for k, v in (kwargs or {}).items()}
    node.meta["val"] = target(*margs, **mkw)
    if like is not None:
        for k in ("nn_module_stack", "stack_trace"):
            if k in like.meta:
                node.meta[k] = like.meta[k]
    return node


ALIASING = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.alias.default)


def aliased(n: Any) -> Any:
    """The tensor ``n`` is the same tensor as: through ``to`` of its own dtype, shape and no copy, and ``alias``."""
    while (isinstance(n, fx.Node) and n.op == "call_function" and n.target in ALIASING
           and not n.kwargs.get("copy", False) and isinstance(n.args[0], fx.Node)):
        v, w = n.meta.get("val"), n.args[0].meta.get("val")
        if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.dtype == w.dtype
                and v.shape == w.shape and v.device == w.device):
            break
        n = n.args[0]
    return n


def noop_set(n: fx.Node) -> bool:
    """Is ``n`` a tensor set to itself: ``set_(x, y)`` with ``x`` and ``y`` the same tensor (``aliased``:
    ``x.set_(x.to(x.dtype))``, what ``module.to(its own dtype)`` does to a parameter)?"""
    return (n.op == "call_function" and n.target is aten.set_.source_Tensor and len(n.args) == 2
            and aliased(n.args[0]) is aliased(n.args[1]))


def unset(g: fx.Graph, n: fx.Node) -> fx.Node:
    """``n``'s value with a no-op ``set_`` (``noop_set``) erased: the tensor it set (before any alias), else
    ``n``; aliases left unread are erased too."""
    if not noop_set(n):
        return n
    root = aliased(n.args[0])
    n.replace_all_uses_with(root)
    dead = [a for a in n.args if isinstance(a, fx.Node)]
    g.erase_node(n)
    while dead:
        d = dead.pop()
        if d is not root and d.op == "call_function" and d.target in ALIASING and not d.users:
            dead += [a for a in d.args if isinstance(a, fx.Node)]
            g.erase_node(d)
    return root
