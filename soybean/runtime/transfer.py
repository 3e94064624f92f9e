"""Whole values moved between device groups by point-to-point messages, and their adjoints (placed regions).

Which rank sends to which, forward and back, and why the backward is the forward's adjoint: ``ir.transfers``.
Here the messages are sent: ``Move`` names a value's move into one region, ``Outbox`` keeps the sends in flight
(they never block, so ``placed.PlacedModule``'s walk cannot deadlock), ``receive`` waits for one.
``tests/test_placement.py`` checks both maps rank by rank, and that what is sent is what was priced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ir.transfers import backward_pairs, forward_pairs


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


class Outbox:
    """Sends in flight: started as soon as a value or gradient is ready, waited on before the next step reuses
    the tags (``flush``); the tensors are kept until then."""

    def __init__(self) -> None:
        self._works: list[tuple[dist.Work, torch.Tensor]] = []
        self.sent_bytes = 0  # every message so far (what ``placement_plan`` prices, checked by the tests)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        self.sent_bytes += t.numel() * t.element_size()
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
