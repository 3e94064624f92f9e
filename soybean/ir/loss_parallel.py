"""Cross-entropy with its classes split (torchtitan's loss parallelism), as planning prices it.

With the logits ``x`` split along the class dim over a group of members, member ``k`` holding classes
``[lo_k, hi_k)``, each row's loss ``lse_i - x_{i, y_i}`` needs two numbers no member holds alone::

    lse_i = log sum_k exp(lse_{i,k}),   lse_{i,k} = log sum_{c in [lo_k, hi_k)} exp(x_ic),
    x_{i, y_i} = sum_k x_{i, y_i} [lo_k <= y_i < hi_k].

Each member computes its two statistics per row and the group all-gathers them (one call per class axis);
backward needs nothing more: ``dl_i / dx_ic = softmax_ic - [c = y_i]`` reads only my classes and ``lse_i``.
The op runs in ``runtime.vocab_loss``; a rule names it by ``CLASS_SPLIT_CROSS_ENTROPY``, a key of
``runtime.synced.SYNC_CALLS``.
"""
from __future__ import annotations

import torch

from .accumulation import widened

CLASS_SPLIT_CROSS_ENTROPY = "cross_entropy_classes"  # the synchronised call cross-entropy's rule asks for


def gathered_bytes(rows: int, members: int, dtype: torch.dtype) -> int:
    """Bytes of one statistics all-gather (its whole result, as ``cost.collectives`` prices a gather): two values
    per row from each of ``members``, in the logits' accumulation type (``accumulation.widened``)."""
    return 2 * rows * members * widened(dtype).itemsize
