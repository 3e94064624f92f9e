"""Causal attention split along the query rows, as planning prices it; it runs in ``runtime.attention``.

A rule names the synchronised call by ``SDPA_ROWS`` (a key of ``runtime.synced.SYNC_CALLS``).  Query rows
``[a, b)`` of a causal attention over ``S`` keys attend to keys ``0 .. i`` for row ``i`` (top-left aligned, as
``is_causal``): row ``i``'s work is ``min(i + 1, S)`` key blocks, so the rank holding the last rows works the most
(``causal_skew``).
"""
from __future__ import annotations

from ..tiling import chunk_range

SDPA_ROWS = "sdpa_rows"  # the synchronised call causal attention's rule asks for when it splits the query rows


def causal_skew(rows: int, keys: int, parts: int) -> float:
    """The busiest of ``parts`` chunks of ``rows`` causal query rows over ``keys`` keys: its work (sum of
    ``min(i + 1, keys)``) over an even share of the whole."""
    def work(a: int, b: int) -> int:
        return sum(min(i + 1, keys) for i in range(a, b))

    total = work(0, rows)
    if parts <= 1 or total == 0:
        return 1.0
    return max(work(*chunk_range(rows, parts, r)) for r in range(parts)) * parts / total
