"""How long soybean's collectives wait for a peer: one home for the timeout that ``launch`` sets and every group
soybean makes (``comm.torch_groups``, the pipeline's groups) waits."""
from __future__ import annotations

import datetime
import os

# How long a collective waits for a peer before it fails (torch's own default is 30 minutes for gloo, 10 for
# NCCL): long enough for a first step, a checkpoint or a slow data batch, short enough that a rank whose peer
# vanished without closing its connections (a node lost) stops instead of hanging.  torchtitan's default is
# also 300 s.  Overridden by ``timeout_s=`` or the environment variable below.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "SOYBEAN_TIMEOUT_S"


def collective_timeout(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``$SOYBEAN_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S` (seconds)."""
    if timeout_s is not None:
        return float(timeout_s)
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: the collective timeout must be positive seconds")
    return value


def group_timeout() -> datetime.timedelta:
    """How long a collective on a group soybean makes waits: :func:`collective_timeout`, which a process group this
    module initialised set to its own timeout.  ``dist.new_group`` without a timeout waits torch's default, 30
    minutes for gloo, whatever the default group's is: a pipeline's ``recv`` from a peer that failed waited that
    long."""
    return datetime.timedelta(seconds=collective_timeout())
