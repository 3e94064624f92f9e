"""Pinning: how a baseline holds a parameter to the tiling it stores it in (``baselines.Layout.pin``).

A pinned tensor is used as it is stored, except on the axes it is gathered whole for use (FSDP's ``gather``);
any other use is a forbidden resharding, priced at ``PINNED`` so that no plan takes it and a layout that needs
one is reported infeasible (``baselines.record``), never priced at the penalty.  The planning graph applies the
rule to a pinned parameter's uses (``graph.build``).
"""
from __future__ import annotations

from ..tiling import Partial, R, Replicate

PINNED = 1e30  # cost of a forbidden resharding


def use_tiling(stored: tuple, gathered: tuple[int, ...]) -> tuple:
    """The tiling a pinned tensor stored as ``stored`` is used in: as stored, but whole (``R``) on the
    ``gathered`` axes."""
    return tuple(R if a in gathered else p for a, p in enumerate(stored))


def pinned_use(stored: tuple, used: tuple, gathered: tuple[int, ...]) -> bool:
    """May a pinned tensor stored as ``stored`` be used as ``used``?  Only in its use tiling, or as a
    pending sum (``P``) where that is whole: ``to_partial`` is local (a row-parallel layer's bias)."""
    return all(u == w or (isinstance(u, Partial) and isinstance(w, Replicate))
               for u, w in zip(used, use_tiling(stored, gathered)))
