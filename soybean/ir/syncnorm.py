"""Synchronised batch norm's statistics, as planning prices them: their accumulation type and bytes.

The op itself (its maths, forward and backward) runs in ``runtime.syncnorm``; a rule names it by
``SYNC_BATCH_NORM``, a key of ``runtime.synced.SYNC_CALLS``.
"""
from __future__ import annotations

import torch

from .accumulation import widened

SYNC_BATCH_NORM = "batch_norm"  # the synchronised call batch norm's rule asks for (``rules.norm``)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics of ``dtype`` tiles are combined in float64 for float32 (float32 for half types)."""
    return torch.float64 if dtype == torch.float32 else widened(dtype)


def stats_bytes(channels: int, dtype: torch.dtype) -> int:
    """Bytes of one statistics all-reduce (forward: the sums of x and x^2; backward: of g and g (x - mean)):
    two values per channel in the accumulation type."""
    return 2 * channels * torch.empty((), dtype=acc_dtype(dtype)).element_size()
