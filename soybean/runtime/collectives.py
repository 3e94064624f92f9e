"""Differentiable data movement between placements, one ``autograd.Function`` each.

Every primitive is the identity on the *logical* (global) tensor; it only changes
how the tensor is laid out over the ``p`` members of one mesh-axis group.  Its
backward is therefore the adjoint of the layout change, written right next to it.

Notation: ``x_k`` is member ``k``'s local tensor, ``E_k`` takes chunk ``k`` along a
dim (:func:`soybean.tiling.chunk_range`), ``G`` is all_gather (``cat_k``), ``g``
the incoming gradient.  Gradient conventions, which make each backward below
the exact adjoint under the matching inner product:

* Shard ``S(d)``: the gradient is sharded alike; ``<a, b> = sum_k <a_k, b_k>``.
* Replicate ``R``: every member holds the full gradient; ``<a, b> = <a_0, b_0>``.
  Exception (``grad_partial`` / :func:`grad_all_reduce`): when the consumer of
  an ``R`` tensor split its work, member ``k`` holds only a summand ``g_k`` of the
  gradient and ``<a, b> = sum_k <a_k, b_k>``.
* Partial ``P``: the values are summands, the gradient is replicated (``d sum_k
  x_k / d x_j = I``); ``<a, b> = sum_k <a_k, b_k>``.
* Exception (:func:`grad_to_partial`): an ``R`` tensor whose producer sums the
  members' gradients takes a partial gradient; ``<a, b> = sum_k <a_k, b_k>``.

Every public function is the identity for a group of size 1 and works for
inputs that do not require grad.  Each takes the algorithm its forward collective runs (``algo``) and the
one its adjoint's runs (``back``), ``(name, lp chunks)`` pairs of :mod:`.algorithms`; the backend's own call
by default.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Function

from ..tiling import chunk_range, intersect
from . import algorithms as A
from .algorithms import BACKEND_ALGO, Algo
from .comm import Group, take_chunk

__all__ = ["shard_slice", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "to_partial", "grad_all_reduce",
           "grad_to_partial", "broadcast", "reduce", "halo", "windowed_call", "move_rows"]


def _my_chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    # A fresh tensor, not a view: autograd outputs that alias inputs complicate in-place use.
    return take_chunk(x, dim, group.size, group.index).clone(memory_format=torch.contiguous_format)


# ---- R -> S(dim) and its adjoint S(dim) -> R ----------------------------------------


class _ShardSlice(Function):
    """R -> S(dim):  ``y_k = E_k x``.

    Adjoint: ``<E_k x, g_k>`` summed over k is ``<x, G g>``, so the replicated
    gradient of ``x`` is ``G g`` on every member (all_gather).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, back: Algo) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.full, ctx.back = group, dim, x.shape[dim], back
        return _my_chunk(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return A.all_gather(ctx.group, g.contiguous(), ctx.dim, ctx.full, ctx.back), None, None, None


class _AllGather(Function):
    """S(dim) -> R:  ``y = G x = cat_k x_k``.

    Adjoint with a replicated gradient ``g``: ``<G x, g> = sum_k <x_k, E_k g>``,
    so member k keeps its chunk ``E_k g``.  With a partial gradient (``grad_partial``:
    member k holds a summand ``g_k``), ``sum_k <G x, g_k> = sum_k <x_k, E_k sum_j g_j>``:
    reduce_scatter.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, full: int, grad_partial: bool, algo: Algo,
                back: Algo) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.grad_partial, ctx.back = group, dim, grad_partial, back
        return A.all_gather(group, x.contiguous(), dim, full, algo)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        gx = A.reduce_scatter(ctx.group, g.contiguous(), ctx.dim, ctx.back) if ctx.grad_partial else \
            _my_chunk(g, ctx.group, ctx.dim)
        return gx, None, None, None, None, None, None


# ---- P -> R and its adjoint R -> P --------------------------------------------------


class _AllReduce(Function):
    """P -> R:  ``y = sum_k x_k`` on every member.

    Adjoint: ``<sum_k x_k, g> = sum_k <x_k, g>``: every summand's gradient is the
    replicated ``g`` itself (identity).  Megatron's ``g`` operator.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algo: Algo) -> torch.Tensor:
        return A.all_reduce(group, x, algo)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g, None, None


class _ToPartial(Function):
    """R -> P:  ``y_0 = x``, ``y_k = 0`` for ``k > 0`` (the summands add up to ``x``).

    Adjoint: ``sum_k <y_k, g> = <x, g>`` with the replicated gradient ``g`` of a
    partial tensor, so ``x``'s replicated gradient is ``g`` (identity).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return x.clone() if group.index == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g, None


# ---- P -> S(dim) and its adjoint S(dim) -> R (gradient side) ------------------------


class _ReduceScatter(Function):
    """P -> S(dim):  ``y_k = E_k sum_j x_j``.

    Adjoint: ``sum_k <E_k sum_j x_j, g_k> = sum_j <x_j, G g>``: every summand's
    (replicated) gradient is the all_gather of the sharded ``g``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, algo: Algo, back: Algo) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.full, ctx.back = group, dim, x.shape[dim], back
        return A.reduce_scatter(group, x.contiguous(), dim, algo)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return A.all_gather(ctx.group, g.contiguous(), ctx.dim, ctx.full, ctx.back), None, None, None, None


# ---- S(src) -> S(dst), self-adjoint up to swapping the dims -------------------------


class _AllToAll(Function):
    """S(src) -> S(dst):  ``y_k = cat_j E^{dst}_k x_j`` along ``src``.

    The map only permutes entries, so its adjoint is its inverse: the all_to_all
    from S(dst) back to S(src), whose full source length is ``x.shape[dst]``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
        ctx.group, ctx.src_dim, ctx.dst_dim, ctx.full_dst = group, src_dim, dst_dim, x.shape[dst_dim]
        return group.all_to_all(x.contiguous(), src_dim, dst_dim, full_src)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        gx = ctx.group.all_to_all(g.contiguous(), ctx.dst_dim, ctx.src_dim, ctx.full_dst)
        return gx, None, None, None, None


class _MoveRows(Function):
    """Rows to the members that take them (mixture-of-experts dispatch): ``x_k``'s rows lie in blocks of
    ``send[j]`` rows for member ``j``, in member order; ``y_k`` is the blocks sent to ``k``, in sender order
    (``recv[j]`` rows from ``j``).

    A permutation of the rows of every member together, so its adjoint is its inverse: the same move with
    ``send`` and ``recv`` swapped (``<a, b> = sum_k <a_k, b_k>``).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, send: tuple[int, ...], recv: tuple[int, ...]
                ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _move(x, group, send, recv)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return _move(g, ctx.group, ctx.recv, ctx.send), None, None, None


def _move(x: torch.Tensor, group: Group, send: tuple[int, ...], recv: tuple[int, ...]) -> torch.Tensor:
    """``_MoveRows``' forward: one all-to-all of the rows (``Group.all_to_all_rows``)."""
    return group.all_to_all_rows(x.contiguous(), send, recv)


def move_rows(x: torch.Tensor, group: Group, send: tuple[int, ...], recv: tuple[int, ...]) -> torch.Tensor:
    """``x``'s rows (blocks of ``send[j]`` for member ``j``) to their members; ``recv[j]`` rows come from ``j``.
    Backward moves the gradients' rows back (``_MoveRows``)."""
    return x if group.size == 1 else _MoveRows.apply(x, group, tuple(send), tuple(recv))


# ---- R consumed by split compute: identity forward, all_reduce backward -------------


class _GradAllReduce(Function):
    """Megatron's ``f``:  ``y = x`` (R -> R), but the consumer split its work, so
    member k's gradient ``g_k`` is a summand.

    Adjoint: ``sum_k <x, g_k> = <x, sum_k g_k>``: the replicated gradient is the
    all_reduce of the summands.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, back: Algo) -> torch.Tensor:
        ctx.group, ctx.back = group, back
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return A.all_reduce(ctx.group, g, ctx.back), None, None


class _GradToPartial(Function):
    """``y = x`` (R -> R), but ``x``'s producer collects partial gradients (sums the
    members' gradients once for all its consumers), while ``y``'s gradient ``g`` is
    replicated: member 0 passes ``g`` on, the others pass 0, so the sum counts it once.

    Adjoint: ``<x, g> = sum_k <x, [k = 0] g>`` (replicated pairing on the output,
    summed pairing on the input).  Backward of :class:`_ToPartial` turned around.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.index = group.index
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return (g if ctx.index == 0 else torch.zeros_like(g)), None


# ---- one member's tensor to all, and all summed at one member: adjoints of each other -----


class _Broadcast(Function):
    """``y_k = x_root`` on every member (the others' ``x`` is not read: its gradient is zero).

    Adjoint, pairing summed over members on both sides: ``sum_k <x_root, g_k> = <x_root, sum_k g_k>``, so the
    root's gradient is the reduce of the ``g_k`` to the root, every other member's is zero.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, root: int, algo: Algo, back: Algo) -> torch.Tensor:
        ctx.group, ctx.root, ctx.back = group, root, back
        return A.broadcast(group, x, root, algo)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return A.reduce(ctx.group, g.contiguous(), ctx.root, ctx.back), None, None, None, None


class _Reduce(Function):
    """``y_root = sum_j x_j``, ``y_k = 0`` on the other members.

    Adjoint: ``sum_k <y_k, g_k> = <sum_j x_j, g_root> = sum_j <x_j, g_root>``: every member's gradient is the
    root's ``g`` (broadcast).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, root: int, algo: Algo, back: Algo) -> torch.Tensor:
        ctx.group, ctx.root, ctx.back = group, root, back
        return A.reduce(group, x, root, algo)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return A.broadcast(ctx.group, g.contiguous(), ctx.root, ctx.back), None, None, None, None


# ---- S(dim) -> windows of S(dim): the halo exchange and its adjoint ------------------


Windows = tuple[tuple[int, int], ...]


class _Halo(Function):
    """S(dim) -> windows:  member ``k`` holds chunk ``[lo_k, hi_k)`` of a length-``full`` dim and gets
    rows ``[s_k, e_k)`` (``windows[k]``) of the whole: its own rows, its neighbours' (point to point),
    and ``fill`` outside ``[0, full)``.  ``y_k = W_k x + f_k`` with ``W_k`` a row selection.

    Adjoint (``f_k`` is constant): ``sum_k <W_k x, g_k> = sum_j <x_j, sum_k E_j W_k^T g_k>``: each
    member sends the gradient rows of the window it received from member ``j`` back to ``j``, which
    adds them to the gradient of its own rows (rows read by several windows sum); fill rows drop.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, full: int, windows: Windows,
                fill: float) -> torch.Tensor:
        p, me = group.size, group.index
        chunks = [chunk_range(full, p, j) for j in range(p)]
        ctx.group, ctx.dim, ctx.windows, ctx.chunks, ctx.shape = group, dim, windows, chunks, x.shape
        lo, _ = chunks[me]
        s, e = windows[me]
        sends: dict[int, torch.Tensor] = {}
        for j in range(p):
            a, b = intersect(windows[j], chunks[me])
            if j != me and b > a:
                sends[j] = x.narrow(dim, a - lo, b - a)
        recvs = {}
        for j in range(p):
            a, b = intersect((s, e), chunks[j])
            if j != me and b > a:
                recvs[j] = tuple(b - a if d == dim else n for d, n in enumerate(x.shape))
        # Every member knows every window: when no member needs another's rows, nobody exchanges.
        ctx.moves = any(intersect(windows[k], chunks[j])[1] > intersect(windows[k], chunks[j])[0]
                        for k in range(p) for j in range(p) if j != k)
        got = group.exchange(sends, recvs, x) if ctx.moves else {}
        out = x.new_full(tuple(e - s if d == dim else n for d, n in enumerate(x.shape)), fill)
        a, b = intersect((s, e), chunks[me])
        if b > a:
            out.narrow(dim, a - s, b - a).copy_(x.narrow(dim, a - lo, b - a))
        for j, t in got.items():
            out.narrow(dim, max(s, chunks[j][0]) - s, t.shape[dim]).copy_(t)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        group, dim, windows, chunks = ctx.group, ctx.dim, ctx.windows, ctx.chunks
        me = group.index
        lo, _ = chunks[me]
        s, _ = windows[me]
        sends = {}
        for j in range(group.size):
            a, b = intersect(windows[me], chunks[j])
            if j != me and b > a:
                sends[j] = g.narrow(dim, a - s, b - a).contiguous()
        recvs = {}
        for j in range(group.size):
            a, b = intersect(windows[j], chunks[me])
            if j != me and b > a:
                recvs[j] = tuple(b - a if d == dim else n for d, n in enumerate(ctx.shape))
        got = group.exchange(sends, recvs, g) if ctx.moves else {}
        gx = g.new_zeros(ctx.shape)
        a, b = intersect(windows[me], chunks[me])
        if b > a:
            gx.narrow(dim, a - lo, b - a).add_(g.narrow(dim, a - s, b - a))
        for j, t in got.items():
            gx.narrow(dim, max(windows[j][0], lo) - lo, t.shape[dim]).add_(t)
        return gx, None, None, None, None, None


# ---- public functions: identity on a single member, else the Function --------------


def shard_slice(x: torch.Tensor, group: Group, dim: int, view: bool = False, back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """R -> S(dim): keep my chunk; backward all_gather.

    ``view``: when ``x`` needs no gradient, a contiguous chunk is returned as a view of ``x``
    instead of a copy (for a data input nothing writes to, this saves copying every batch).
    """
    if group.size == 1:
        return x
    dim = dim % x.ndim
    if view and not (x.requires_grad and torch.is_grad_enabled()):
        return take_chunk(x, dim, group.size, group.index).contiguous()  # a view when already contiguous
    return _ShardSlice.apply(x, group, dim, back)


def all_gather(x: torch.Tensor, group: Group, dim: int, full: int, grad_partial: bool = False,
               algo: Algo = BACKEND_ALGO, back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """S(dim) -> R, ``full`` = gathered length; backward slice (or reduce_scatter if ``grad_partial``)."""
    return x if group.size == 1 else _AllGather.apply(x, group, dim % x.ndim, full, grad_partial, algo, back)


def all_reduce(x: torch.Tensor, group: Group, algo: Algo = BACKEND_ALGO) -> torch.Tensor:
    """P -> R: sum; backward identity."""
    return x if group.size == 1 else _AllReduce.apply(x, group, algo)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int, algo: Algo = BACKEND_ALGO,
                   back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """P -> S(dim): sum, keep my chunk; backward all_gather."""
    return x if group.size == 1 else _ReduceScatter.apply(x, group, dim % x.ndim, algo, back)


def all_to_all(x: torch.Tensor, group: Group, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim), ``full_src`` = length of ``src_dim``; backward the inverse all_to_all."""
    return x if group.size == 1 else _AllToAll.apply(x, group, src_dim % x.ndim, dst_dim % x.ndim, full_src)


def to_partial(x: torch.Tensor, group: Group) -> torch.Tensor:
    """R -> P: ``x`` on member 0, zeros elsewhere; backward identity."""
    return x if group.size == 1 else _ToPartial.apply(x, group)


def grad_all_reduce(x: torch.Tensor, group: Group, back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """Identity forward, all_reduce backward (R input consumed by split compute)."""
    return x if group.size == 1 else _GradAllReduce.apply(x, group, back)


def broadcast(x: torch.Tensor, group: Group, root: int, algo: Algo = BACKEND_ALGO,
              back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """Member ``root``'s ``x`` on every member; backward reduce to ``root``."""
    return x if group.size == 1 else _Broadcast.apply(x, group, root, algo, back)


def reduce(x: torch.Tensor, group: Group, root: int, algo: Algo = BACKEND_ALGO,
           back: Algo = BACKEND_ALGO) -> torch.Tensor:
    """``sum_j x_j`` on member ``root`` (zeros elsewhere); backward broadcast from ``root``."""
    return x if group.size == 1 else _Reduce.apply(x, group, root, algo, back)


def grad_to_partial(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; backward keeps the (replicated) gradient on member 0 only, making it partial."""
    return x if group.size == 1 else _GradToPartial.apply(x, group)


# The attribute of a window made by ``halo`` that says how to rebuild it from the tile it came from (``windowed_call``):
# (the tile, dim, where my rows start in the tile, where they start in the window, how many).  Kept by the window
# itself, so it goes with it.
_WINDOW = "_sb_window"


def halo(x: torch.Tensor, group: Group, dim: int, full: int, windows: Windows, fill: float = 0.0) -> torch.Tensor:
    """My window ``windows[index]`` of the S(dim) tensor (length ``full``) with ``fill`` outside it; backward
    returns the window gradients to the rows' owners and sums them (see :class:`_Halo`)."""
    dim = dim % x.ndim
    if all(w == chunk_range(full, group.size, k) for k, w in enumerate(windows)):
        return x  # every window is its member's own chunk (a 2x2 pool of stride 2 on even tiles)
    out = _Halo.apply(x, group, dim, full, windows, fill)
    s, e = windows[group.index]
    lo, _ = chunk_range(full, group.size, group.index)
    a, b = intersect((s, e), chunk_range(full, group.size, group.index))
    if b > a:  # the window is my rows [a, b) with others' rows and fill around them
        setattr(out, _WINDOW, (x, dim, a - lo, a - s, b - a))
    return out


def _pack(t: torch.Tensor) -> Any:
    """A halo window an op saves for backward is kept as its rows from others (and fill) only: its own
    rows are the tile, which the program keeps anyway."""
    hit = getattr(t, _WINDOW, None)
    if hit is None:
        return t
    x, dim, at, off, n = hit
    before = t.narrow(dim, 0, off).clone()
    after = t.narrow(dim, off + n, t.shape[dim] - off - n).clone()
    return (x, x._version, dim, at, n, before, after)


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    x, version, dim, at, n, before, after = packed
    if x._version != version:
        raise RuntimeError("a tile that a halo window was built from was modified in place before backward")
    return torch.cat([before, x.detach().narrow(dim, at, n), after], dim)


def windowed_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for an op that reads halo windows: what it saves for backward keeps each
    window as its halo rows only and rebuilds it from the tile in backward (``_pack``), so a split
    activation is not held twice, as its tile and as its window."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        return fn(*args, **kwargs)
