"""The type arithmetic on a tensor accumulates in: float32 for the half types, else the tensor's own.

Ring attention's blocks and their gradients (``runtime.ring``, priced by ``rules.attention``), a class-split loss's
statistics (``ir.loss_parallel``) and batch norm's (``ir.syncnorm``, which widens float32 further) read it here, so
what the runtime computes in and what planning prices as sent agree.
"""
from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


def widened(dtype: torch.dtype) -> torch.dtype:
    """float32 for a half type, else ``dtype`` itself."""
    return torch.float32 if dtype in HALF else dtype
