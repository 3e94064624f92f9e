"""Capture's passes: ``PASSES``, the exact in-place rewrites ``capture`` runs on the exported graph, in this order,
each a module of this package named after it (``<name>.<name>(gm)``):

1. ``inline_empty_constants``: an empty tensor constant (a KV cache's start) becomes ``aten.empty``.
2. ``inline_grad_regions``: grad-mode regions that ``torch.export`` wraps in a higher-order op
   (a ``torch.no_grad()`` block, such as Llama's rotary embedding) are inlined, with their
   outputs detached, so every remaining node is a plain aten op.
3. ``drop_assertions``: runtime metadata assertions (``_assert_tensor_metadata``: no output,
   no effect on values) are erased, and so are writes nothing reads into tensors forward made.
4. ``functionalize``: in-place updates of values forward made (``shifted[:, 1:] = ids[:, :-1]``,
   ``masked_fill_``) become out-of-place ops, carried to every alias:
   a tiled value read through a resharded copy would otherwise miss the update.
5. ``fold_constant_masks``: an attention mask computed from constants only (Hugging Face builds
   its causal or all-true mask from ``arange`` under ``torch.export``, where eager mode passes
   none) is evaluated once; when it is the causal mask it becomes ``is_causal=True``, when it
   masks nothing it is dropped.  The mask subgraph then disappears: it was one value read by
   every layer.  A mask too large to build is read from its parts (``masks``).
6. ``means_to_sums``: ``mean`` and ``mse_loss(mean)`` become ``sum / n`` and
   ``cross_entropy_loss(reduction='mean')`` becomes ``sum-loss / count`` so that a
   batch-split loss is a pending sum (``Partial``) instead of forcing a gather of
   the logits.
7. ``fuse_routed_experts``: a mixture-of-experts layer's routed experts (transformers' grouped-matmul experts:
   rows sorted by expert, grouped matmuls, weighted and summed back per token) become one op,
   ``soybean::routed_experts``, whose rule splits the tokens, the experts or both.
8. ``squeeze_dims``: ``x.squeeze()`` becomes ``squeeze`` of the dims the example has of size 1, so that a tile
   one row wide keeps its dim and the dims kept can be split.

After them, whichever were given, ``capture`` runs one analysis, ``mark_returned_sums`` (a module here too).
What several passes share is ``common``; ``masks`` is ``fold_constant_masks``' reading of a mask it does not build.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from torch import fx

from . import (
    drop_assertions,
    fold_constant_masks,
    functionalize,
    fuse_routed_experts,
    inline_empty_constants,
    inline_grad_regions,
    means_to_sums,
    squeeze_dims,
)


class Pass(NamedTuple):
    """One rewrite of a captured graph: ``run(gm)`` edits ``gm``'s graph in place (``run_passes`` regenerates its
    code after the last)."""

    name: str
    run: Callable[[fx.GraphModule], None]
    purpose: str  # one line


# Run in this order by ``run_passes`` (the module docstring lists them alike).  The order matters:
# a region's nodes must be inlined before the later passes can see them.
PASSES: tuple[Pass, ...] = (
    Pass("inline_empty_constants", inline_empty_constants.inline_empty_constants,
         "empty tensor constants -> aten.empty in the graph"),
    Pass("inline_grad_regions", inline_grad_regions.inline_grad_regions,
         "inline torch.no_grad() regions, their float outputs detached"),
    Pass("drop_assertions", drop_assertions.drop_assertions,
         "erase _assert_tensor_metadata calls, set_(x, x) and unread writes into fresh tensors"),
    Pass("functionalize", functionalize.functionalize,
         "in-place updates of values forward made -> out-of-place ops"),
    Pass("fold_constant_masks", fold_constant_masks.fold_constant_masks,
         "constant causal/all-true attention masks -> is_causal or none"),
    Pass("means_to_sums", means_to_sums.means_to_sums,
         "mean, mse_loss(mean), cross_entropy(mean) -> sum / count"),
    Pass("fuse_routed_experts", fuse_routed_experts.fuse_routed_experts,
         "routed experts (sort, grouped matmuls, combine) -> one op"),
    Pass("squeeze_dims", squeeze_dims.squeeze_dims, "squeeze() -> squeeze of the dims of size 1 named"),
)


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass] | None = None) -> None:
    """Run ``passes`` on ``gm`` in order; ``None`` means ``PASSES`` (read at call time), then regenerate its code
    once: a pass edits the graph only (each recompiling ``gm`` was 7 of the 8 code generations of a capture)."""
    for p in PASSES if passes is None else passes:
        p.run(gm)
    gm.recompile()
