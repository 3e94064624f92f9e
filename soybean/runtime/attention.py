"""Causal attention on a tile of the query rows (``rules.attention``'s row split of an ``is_causal`` op).

My rows are rows ``[a, b)`` of the whole query sequence (``tiling.nested_range`` over the ``row_axes``); keys
and values are whole.  Row ``a + i`` attends to keys ``0 .. a + i``: the causal mask offset by ``a``, given as an
explicit boolean mask (``tril(diagonal=a)``), so each row's softmax is the serial row's.  Backward is autograd's
through ``scaled_dot_product_attention``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..tiling import nested_range
from .context import current_groups

__all__ = ["sb_sdpa_rows"]


def sb_sdpa_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, *, row_axes: Sequence[int] = (), rows: int = 0) -> torch.Tensor:
    """``scaled_dot_product_attention`` of my query rows (module docstring): ``rows`` in the whole sequence."""
    groups = current_groups()
    lo, _ = nested_range(rows, [(groups[a].size, groups[a].index) for a in row_axes])
    if not is_causal:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, False, scale=scale,
                                              enable_gqa=enable_gqa)
    mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril(lo)
    return F.scaled_dot_product_attention(query, key, value, mask, dropout_p, False, scale=scale,
                                          enable_gqa=enable_gqa)
