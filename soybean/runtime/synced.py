"""The synchronised calls a rule may name (``RuleEntry.sync_call``): what a generated program and the rule
checker run in an op's place when its tiles must talk (``rules.base.register(..., sync_args=, sync_call=)``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ir.attention import SDPA_ROWS
from ..ir.experts import ROUTED_EXPERTS
from ..ir.loss_parallel import CLASS_SPLIT_CROSS_ENTROPY
from ..ir.syncnorm import SYNC_BATCH_NORM
from .attention import sb_sdpa_rows
from .experts import sb_routed_experts
from .syncnorm import sb_batch_norm
from .vocab_loss import sb_cross_entropy

SYNC_CALLS: dict[str, Callable[..., Any]] = {SYNC_BATCH_NORM: sb_batch_norm, ROUTED_EXPERTS: sb_routed_experts,
                                             SDPA_ROWS: sb_sdpa_rows, CLASS_SPLIT_CROSS_ENTROPY: sb_cross_entropy}
