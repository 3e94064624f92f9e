"""Whole values moved between device groups (placed regions): which rank sends to which, forward and back.

A region's value ``v`` is *replicated* on its group ``src`` (every member holds it whole: the full-output
contract) and a region on group ``dst`` reads it.  The move makes ``v`` whole on every member of ``dst``:

* forward: each member of ``dst`` outside ``src`` receives ``v`` from ``src[i mod |src|]``, ``i`` its place in
  ``dst`` (``forward_pairs``); members of both keep their own copy;
* backward: the gradient of that use is replicated on ``dst`` (every member holds it whole), and each member of
  ``src`` needs it exactly once: its own when it is in ``dst``, else the one ``dst[j mod |dst|]`` sends, ``j``
  its place in ``src`` (``backward_pairs``).

Under the replicated inner product (``<a, b> = <a_0, b_0>``, ``runtime.collectives``) the move is the identity on
the logical value, and the backward map, which hands every member of ``src`` one copy of the whole gradient, is
its adjoint: ``<M v, g>_dst = <v, g> = <v, M* g>_src``.  ``placement_plan`` prices these very pairs and
``runtime.transfer`` sends them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def forward_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """(sender, receiver) of each forward message: each member of ``dst`` outside ``src`` receives from
    ``src[i mod |src|]``."""
    return [(src[i % len(src)], h) for i, h in enumerate(dst) if h not in src]


def backward_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """(sender, receiver) of each gradient message: each member of ``src`` outside ``dst`` receives from
    ``dst[j mod |dst|]``."""
    return [(dst[j % len(dst)], g) for j, g in enumerate(src) if g not in dst]


def busiest(pairs: Sequence[tuple[int, int]]) -> int:
    """The most messages one rank sends or receives among ``pairs`` (they run one after the other on it; the
    ranks at the same time)."""
    load = Counter(s for s, _ in pairs) + Counter(d for _, d in pairs)
    return max(load.values(), default=0)
