"""Causal attention split along the query rows, as planning prices it; it runs in ``runtime.attention``.

A rule names the synchronised call by ``SDPA_ROWS`` (a key of ``runtime.synced.SYNC_CALLS``).  Query rows
``[a, b)`` of a causal attention over ``S`` keys attend to keys ``0 .. i`` for row ``i`` (top-left aligned, as
``is_causal``): row ``i``'s work is ``min(i + 1, S)`` key blocks, so the rank holding the last rows works the most
(``causal_skew``).

The zig-zag layout balances it: the rows cut into ``2p`` chunks, member ``r`` of ``p`` computes chunks ``r`` and
``2p - 1 - r`` (one early, one late: ``zigzag_rows``), so every member's work is about ``1 / p`` of the whole
(``zigzag_skew``).  The tiles stay contiguous outside the op: inside it, each member's rows move to the member that
computes them and the results move back (``zigzag_moves``; ``runtime.attention``).
"""
from __future__ import annotations

from functools import lru_cache

from ..tiling import chunk_range, intersect

SDPA = "aten.scaled_dot_product_attention.default"  # the attention op, as ``rules.base.op_name`` names it
SDPA_ROWS = "sdpa_rows"  # the synchronised call causal attention's rule asks for when it splits the query rows
ZIGZAG = "zigzag"  # the strategy variant (``rules.base.Strategy1D.variant``) that computes them in zig-zag layout
RING = "ring"  # the variant splitting the keys and values too, passed around the members (``runtime.ring``)
RING_ZIGZAG = "ring_zigzag"  # ring attention computed in the zig-zag layout (causal)


Range = tuple[int, int]  # [start, stop) of query rows


def _work(a: int, b: int, keys: int) -> int:
    """Causal work of rows ``[a, b)``: ``sum min(i + 1, keys)``, in closed form."""
    full = max(0, min(b, keys) - a)  # rows below ``keys`` attend to ``i + 1`` keys
    lo = min(a, keys)
    ramp = (lo + 1 + lo + full) * full // 2 if full else 0
    return ramp + max(0, b - max(a, keys)) * keys


def causal_fraction(rows: int, keys: int) -> float:
    """The share of a ``rows x keys`` score matrix a causal attention computes (the fused kernels skip the blocks
    above the diagonal): ``sum_i min(i + 1, keys) / (rows keys)``, about one half for a square one.  Measured on
    an H100 (``scripts/time_ops_cuda.py``): causal attention at 2 x 32 heads x 8,192 x 128 took 1.78 ms forward,
    the same without the mask 3.28 ms."""
    return _work(0, rows, keys) / (rows * keys) if rows and keys else 1.0


@lru_cache(maxsize=4096)  # pure in its integers; a table asks again per strategy (256 parts: 256 chunks each time)
def causal_skew(rows: int, keys: int, parts: int) -> float:
    """The busiest of ``parts`` chunks of ``rows`` causal query rows over ``keys`` keys: its work (sum of
    ``min(i + 1, keys)``) over an even share of the whole."""
    total = _work(0, rows, keys)
    if parts <= 1 or total == 0:
        return 1.0
    return max(_work(*chunk_range(rows, parts, r), keys) for r in range(parts)) * parts / total


def zigzag_rows(rows: int, parts: int, r: int) -> tuple[Range, Range]:
    """Member ``r``'s rows in the zig-zag layout: chunks ``r`` and ``2 parts - 1 - r`` of ``2 parts``."""
    return chunk_range(rows, 2 * parts, r), chunk_range(rows, 2 * parts, 2 * parts - 1 - r)


@lru_cache(maxsize=4096)
def zigzag_skew(rows: int, keys: int, parts: int) -> float:
    """``causal_skew`` in the zig-zag layout: the busiest member's work over an even share."""
    total = _work(0, rows, keys)
    if parts <= 1 or total == 0:
        return 1.0
    return max(sum(_work(a, b, keys) for a, b in zigzag_rows(rows, parts, r)) for r in range(parts)) * parts / total


def zigzag_moves(rows: int, parts: int) -> list[list[list[Range]]]:
    """``moves[s][d]``: the row ranges (ascending) that member ``s``, holding contiguous chunk ``s`` of ``parts``,
    sends to member ``d``, which computes them in the zig-zag layout (``s == d``: the ones it keeps)."""
    out: list[list[list[Range]]] = []
    for s in range(parts):
        a, b = chunk_range(rows, parts, s)
        out.append([[(lo, hi) for lo, hi in (intersect((a, b), z) for z in zigzag_rows(rows, parts, d)) if lo < hi]
                    for d in range(parts)])
    return out


def _met(x: Range, y: Range) -> int:
    """How many rows ranges ``x`` and ``y`` share."""
    lo, hi = intersect(x, y)
    return max(0, hi - lo)


@lru_cache(maxsize=4096)
def zigzag_leaving(rows: int, parts: int) -> int:
    """The most rows any member sends away (or receives) in one zig-zag move (``zigzag_moves``).  Both layouts
    cover the rows once, so member ``m`` sends all of its contiguous chunk but what it computes itself, and receives
    all it computes but what it holds: ``O(parts)``, where walking the moves is ``O(parts^2)`` (256 parts: 12 s of a
    Llama-3-8B table on 256x2x2)."""
    most = 0
    for m in range(parts):
        held, mine = chunk_range(rows, parts, m), zigzag_rows(rows, parts, m)
        kept = sum(_met(held, z) for z in mine)
        most = max(most, held[1] - held[0] - kept, sum(b - a for a, b in mine) - kept)
    return most
