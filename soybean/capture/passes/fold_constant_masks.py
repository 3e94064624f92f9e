"""``fold_constant_masks``: an attention mask computed from constants only (Hugging Face builds its causal or
all-true mask from ``arange`` under ``torch.export``, where eager mode passes none) is evaluated once; when it is the
causal mask it becomes ``is_causal=True``, when it masks nothing it is dropped.  The mask subgraph then disappears:
it was one value read by every layer.  A mask too large to build is read from its parts (``masks``)."""
from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any, cast

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from .common import CONSTANTS, aten
from .masks import CAUSAL, judged, mask_meaning

MAX_FOLDED_MASK = 1 << 28  # elements: larger constant masks are kept as computed


def _mutates(n: fx.Node) -> bool:
    """Does the node's op write into an argument (``Tensor(a!)`` in its schema)?"""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _constant_nodes(g: fx.Graph, known: Collection[str] = ()) -> set[fx.Node]:
    """Nodes whose value depends on no placeholder but the ``known`` constants (by name) and no random draw
    (so on the shapes and those constants only).

    Empty when an in-place op writes to such a node: its value would then depend on the order (``detach_`` changes
    no value and does not count).
    """
    const: set[fx.Node] = {n for n in g.nodes if n.op == "placeholder" and n.name in known}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        reads = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, fx.Node)]
        if _mutates(n) and n.target is not aten.detach_.default and any(a in const for a in reads):
            return set()
        if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()) and all(a in const for a in reads):
            const.add(n)
    return const


def _evaluate(node: fx.Node, memo: dict[fx.Node, Any]) -> Any:
    """The value of a constant node, computed on the CPU (device arguments are moved there)."""
    cpu = torch.device("cpu")

    def value(a: Any) -> Any:
        return memo[a] if isinstance(a, fx.Node) else cpu if isinstance(a, torch.device) else a

    for n in _cone(node):
        if n not in memo:
            args, kwargs = tree_map(value, (tuple(n.args), dict(n.kwargs)))
            # Every node of a constant cone is a call_function node: its target is callable.
            memo[n] = cast(Callable[..., Any], n.target)(*args, **kwargs)
    return memo[node]


def _cone(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it reads, in topological order."""
    seen: dict[fx.Node, None] = {}

    def visit(n: fx.Node) -> None:
        if n in seen:
            return
        for a in n.all_input_nodes:
            visit(a)
        seen[n] = None

    visit(node)
    return list(seen)


def _meaning(mask: fx.Node, scores: tuple[int, ...], memo: dict[fx.Node, Any]) -> str | None:
    """What the constant boolean ``mask`` means for attention scores of shape ``scores`` (``masks.CAUSAL``,
    ``masks.ALL``), or None: unknown, a mask that does not broadcast to them, or one with an op that cannot run
    here (the mask is kept).  ``memo``: the constant nodes' values computed so far."""
    L, S = scores[-2], scores[-1]
    try:
        if math.prod(scores) > MAX_FOLDED_MASK:  # too large to build: read its meaning from its parts
            if torch.broadcast_shapes(tuple(mask.meta["val"].shape), scores) != scores:
                return None
            return mask_meaning(mask, lambda c: _evaluate(c, memo), MAX_FOLDED_MASK)
        # judged as evaluated, not expanded: a GPT-2 mask expanded to batch x heads x 1024 x 1024 took 0.25 s
        m = _evaluate(mask, memo)
        m.expand(scores)  # a view: checks the mask broadcasts to the scores
        return judged(m, L, S)
    except (RuntimeError, NotImplementedError, TypeError):  # an op that cannot run here: keep the mask
        return None


def fold_constant_masks(gm: fx.GraphModule) -> None:
    """Replace a constant boolean ``attn_mask`` of ``scaled_dot_product_attention`` by what it means.

    The mask is evaluated for the captured shapes and broadcast to the scores' ``(..., L, S)``:
    all true -> no mask; ``tril`` (``L == S``) -> ``is_causal=True``.  Both are exact.  A mask whose scores are over
    ``MAX_FOLDED_MASK`` elements is not built: its meaning is read from its small parts (``masks.mask_meaning``:
    the comparison of key and query positions transformers builds).  Other masks and masks that depend on inputs
    stay.  When a mask
    was folded, constant nodes left without users (the mask's subgraph) are erased.
    """
    g = gm.graph
    constants: dict[str, torch.Tensor] = gm.meta.get(CONSTANTS, {})
    const = _constant_nodes(g, constants)
    memo: dict[fx.Node, Any] = {n: constants[n.name] for n in const if n.op == "placeholder"}
    # Every layer's attention reads the one mask value: its meaning for the scores' shape is decided once (judging
    # Llama-3-8B's 8,192 x 8,192 mask again in each of 32 layers was 4 s of a 6.8 s capture at batch 1).
    meanings: dict[tuple[fx.Node, tuple[int, ...]], str | None] = {}
    folded = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        args = list(n.args) + [None] * (6 - len(n.args))
        q, k, mask = args[0], args[1], args[3] if args[3] is not None else n.kwargs.get("attn_mask")
        causal = args[5] if args[5] is not None else n.kwargs.get("is_causal", False)
        if mask not in const or causal or mask.meta["val"].dtype != torch.bool:
            continue
        scores = tuple(q.meta["val"].shape[:-1]) + (k.meta["val"].shape[-2],)
        if (mask, scores) not in meanings:
            meanings[(mask, scores)] = _meaning(mask, scores, memo)
        meaning = meanings[(mask, scores)]
        if meaning is None:
            continue
        is_causal = meaning == CAUSAL
        kwargs = {key: v for key, v in n.kwargs.items() if key not in ("attn_mask", "dropout_p", "is_causal")}
        dropout_p = args[4] if args[4] is not None else n.kwargs.get("dropout_p", 0.0)
        n.args = (q, k, args[2], None, dropout_p, is_causal)
        n.kwargs = kwargs
        folded += 1
    if not folded:
        return
    for dead in reversed(list(g.nodes)):
        if dead in const and dead.op == "call_function" and not dead.users and not _mutates(dead):
            g.erase_node(dead)
    g.lint()
