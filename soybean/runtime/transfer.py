"""Whole values moved between device groups by point-to-point messages, and their adjoints (placed regions).

A region's value ``v`` is *replicated* on its group ``G`` (every member holds it whole: the full-output
contract) and a region on group ``H`` reads it.  The move makes ``v`` whole on every member of ``H``:

* forward: each ``h`` in ``H`` outside ``G`` receives ``v`` from ``G[i mod |G|]``, ``i`` its place in ``H``
  (``forward_pairs``); members of both keep their own copy;
* backward: the gradient of ``v`` is replicated on ``H`` too (every member of ``H`` holds the whole gradient
  of its region's use), and each member of ``G`` needs that use's gradient exactly once: its own when it is in
  ``H``, else the one ``H[j mod |H|]`` sends, ``j`` its place in ``G`` (``backward_pairs``).

Under the replicated inner product (``<a, b> = <a_0, b_0>``, ``runtime.collectives``) the move is the identity on
the logical value, and the backward map, which hands every member of ``G`` one copy of the whole gradient, is
its adjoint: ``<M v, g>_H = <v, g> = <v, M* g>_G``.  Two uses of ``v`` are two moves whose gradients the
producer sums (``placed``), as autograd sums two reads.  ``tests/test_placement.py`` checks both maps
rank by rank.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Move:
    """Value ``value`` made on ranks ``src`` (a region's group) and read by a region on ranks ``dst``; ``tag``
    names its messages (forward ``2 tag``, backward ``2 tag + 1``); ``grad``: its gradient flows back."""

    value: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    tag: int
    grad: bool

    def forward_pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver) of each forward message."""
        return forward_pairs(self.src, self.dst)

    def backward_pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver) of each gradient message (none when the value carries no gradient)."""
        return backward_pairs(self.src, self.dst) if self.grad else []


def forward_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """Each member of ``dst`` outside ``src`` receives from ``src[i mod |src|]`` (module docstring)."""
    return [(src[i % len(src)], h) for i, h in enumerate(dst) if h not in src]


def backward_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """Each member of ``src`` outside ``dst`` receives the gradient from ``dst[j mod |dst|]``."""
    return [(dst[j % len(dst)], g) for j, g in enumerate(src) if g not in dst]


def moved_bytes(move: Move, nbytes: int) -> tuple[int, int]:
    """Bytes sent forward and backward by ``move`` of a value of ``nbytes``: what ``placement_plan.send_s``
    prices (each message a whole value)."""
    return len(move.forward_pairs()) * nbytes, len(move.backward_pairs()) * nbytes


class Outbox:
    """Sends in flight: started as soon as a value or gradient is ready, waited on before the next step reuses
    the tags (``flush``); the tensors are kept until then."""

    def __init__(self) -> None:
        self._works: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        work = dist.isend(t, dst, tag=tag)
        assert work is not None  # isend always returns its request
        self._works.append((work, t))

    def flush(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works.clear()


def receive(like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
    """A tensor shaped like ``like``, received from rank ``src`` (blocking)."""
    buf = torch.empty_like(like, memory_format=torch.contiguous_format)
    dist.recv(buf, src, tag=tag)
    return buf
