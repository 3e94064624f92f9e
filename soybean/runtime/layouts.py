"""Ops that read a tensor's storage rather than its elements, run on a value laid out as the serial run laid it out.

``as_strided(x, size, stride, offset)`` reads ``storage[offset + sum_k i_k stride_k]``: which elements it reads
depends on how ``x`` lies in memory, not only on ``x``'s values.  A program's value need not lie as the serial one
did: a collective returns a contiguous tensor where the serial value was a transposed view (Longformer's
``_chunk`` reads a ``(batch * heads, seq, head)`` view of a ``(seq, batch * heads, head)`` tensor with the strides
it had, ``[16, 32768, 128, 1]``), and the same strides on a contiguous copy read other elements.  So the program
lays the value out with the serial strides first (a copy, only where the strides differ), and shifts an explicit
offset by the serial value's own, so that ``offset - serial_offset`` is the same position relative to the value's
first element.  This is exact where the serial value's elements are all of the storage the op reads, which
lowering checks (``codegen.lower``); the copy is differentiable, so ``as_strided``'s backward sums overlapping
windows' gradients as the serial one does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["laid_as", "sb_as_strided", "reads_within"]


def laid_as(x: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """``x`` with strides ``stride``: ``x`` itself where it has them, else a (differentiable) copy so laid out."""
    if tuple(x.stride()) == tuple(stride):
        return x
    return torch.empty_strided(tuple(x.shape), tuple(stride), dtype=x.dtype, device=x.device).copy_(x)


def sb_as_strided(x: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None, *,
                  serial_stride: Sequence[int], serial_offset: int) -> torch.Tensor:
    """``aten.as_strided(x, size, stride, storage_offset)`` as the serial program ran it, whose input had strides
    ``serial_stride`` and storage offset ``serial_offset``."""
    x = laid_as(x, serial_stride)
    if storage_offset is not None:
        storage_offset = storage_offset - serial_offset + int(x.storage_offset())
    return torch.ops.aten.as_strided.default(x, list(size), list(stride), storage_offset)


def reads_within(shape: Sequence[int], stride: Sequence[int], offset: int, size: Sequence[int],
                 read_stride: Sequence[int], read_offset: int) -> bool:
    """Whether ``as_strided(x, size, read_stride, read_offset)`` reads only storage that ``x`` (``shape``,
    ``stride``, ``offset``) covers, every element of its span being one of ``x``'s: ``x`` is non-overlapping and
    dense (its strides, ordered, are the running products of its sizes, size-1 dims aside), and the op's least and
    greatest positions lie in ``[offset, offset + numel)``.  Strides are taken non-negative (as ``as_strided``
    requires)."""
    dims = sorted((st, n) for n, st in zip(shape, stride) if n != 1)
    run = 1
    for st, n in dims:
        if st != run:
            return False
        run *= n
    numel = math.prod(shape)
    if numel == 0 or any(n == 0 for n in size):
        return True
    last = read_offset + sum((n - 1) * st for n, st in zip(size, read_stride))
    return offset <= read_offset and last < offset + numel
