"""Process groups along one mesh axis: the four collectives soybean needs.

Every collective works on the members of one mesh-axis group (``size`` members,
mine at position ``index`` = my coordinate on that axis).  Sharded tiles follow
:func:`soybean.tiling.chunk_range`: with ``c = ceil(n / p)`` member ``k`` holds
``[k c, min((k+1) c, n))`` of a length-``n`` dimension, so tiles may be uneven or
empty and every member can derive everybody's tile length from ``n`` alone.

With ``x_k`` member ``k``'s tensor and ``E_k`` "take chunk ``k`` along ``dim``":

* ``all_reduce``:      ``y_k = sum_j x_j``
* ``all_gather``:      ``y_k = cat_j x_j`` along ``dim`` (``x_j = E_j x``)
* ``reduce_scatter``:  ``y_k = E_k sum_j x_j``
* ``all_to_all``:      ``y_k = cat_j E_k^{dst} x_j`` along ``src_dim``: gather
  ``src_dim``, scatter ``dst_dim``.
* ``broadcast``:       ``y_k = x_root``;  ``reduce``: ``y_root = sum_j x_j`` (``y_k = 0`` elsewhere)
* ``exchange``:        point to point: member ``k`` sends ``t_{k->j}`` to each ``j`` it names
  and receives ``t_{j->k}`` of a shape it names (the halo exchange's transport).

Two implementations:

* :class:`ThreadGroup` (built by :class:`ThreadWorld`): all ranks are threads of
  one process and swap tensors through shared slots -- the fast test tier.
* :class:`TorchGroup` (built by :func:`torch_groups`): a ``torch.distributed``
  process group; gloo for CPU tensors, NCCL for CUDA tensors.
"""
from __future__ import annotations

import atexit
import functools
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..mesh import Mesh
from ..tiling import chunk_range
from .timeouts import group_timeout

# torch 2.13 renamed the fixed-size collectives (the old names warn); torch >= 2.5 has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["AsyncGroup", "Group", "ThreadGroup", "ThreadWorld", "TorchGroup", "Work", "torch_groups", "chunk_len",
           "take_chunk"]


@runtime_checkable
class Group(Protocol):
    """The members of one mesh-axis group, seen from one member."""

    size: int
    index: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``sum_j t_j`` (same on every member)."""
        ...

    def all_gather(self, t: torch.Tensor, dim: int, full: int) -> torch.Tensor:
        """``cat_j t_j`` along ``dim``; ``t_j`` is chunk ``j`` of a length-``full`` dim."""
        ...

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Chunk ``index`` along ``dim`` of ``sum_j t_j``."""
        ...

    def all_to_all(self, t: torch.Tensor, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
        """Input: my chunk of ``src_dim`` (length ``full_src`` in all), all of ``dst_dim``.
        Output: all of ``src_dim``, my chunk of ``dst_dim``."""
        ...


    def all_to_all_rows(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        """Rows (dim 0) to the members that take them: ``t`` is blocks of ``send[j]`` rows for member ``j``, in
        member order; the result is the blocks sent to me, ``recv[j]`` rows from member ``j``, in member order
        (sizes known only at run time: mixture-of-experts dispatch)."""
        ...

    def broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """Member ``root``'s ``t`` (a new tensor on every member)."""
        ...

    def reduce(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """``sum_j t_j`` on member ``root``, zeros on the others."""
        ...

    def exchange(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
                 like: torch.Tensor) -> dict[int, torch.Tensor]:
        """Send ``sends[j]`` to member ``j``; receive a tensor of ``recv_shapes[j]`` from member ``j``
        (every pair agrees: ``j`` names me with that shape), with ``like``'s dtype and device.  Members absent
        from both exchange nothing."""
        ...


class Work(Protocol):
    """A started collective."""

    def wait(self) -> Any:
        """Block until the collective's result is in place."""
        ...


class AsyncGroup(Group, Protocol):
    """A group that can also start a sum and return before it completes (``TorchGroup``; the thread
    tier's groups cannot, and callers test for the method).  ``in_flight``: the sums started on it that nobody
    has waited for yet (``runtime.pending``: each has an idempotent ``wait``), kept by the group, which waits for
    them at exit; a module waits for its groups' at its next forward (``pending.wait_all``)."""

    in_flight: list[Any]

    def all_reduce_inplace_async(self, t: torch.Tensor) -> Work:
        """Start summing ``t`` in place; ``wait`` on the result before reading ``t``."""
        ...

    def exchange_start(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
                       like: torch.Tensor) -> Work:
        """Start ``exchange``; ``wait()`` returns its received tensors.  The sent tensors must not change until
        then."""
        ...


# ---- chunk arithmetic shared by both implementations ------------------------------


def chunk_len(n: int, p: int, k: int) -> int:
    """Length of chunk ``k`` of ``p`` of a length-``n`` dimension."""
    a, b = chunk_range(n, p, k)
    return b - a


def take_chunk(t: torch.Tensor, dim: int, p: int, k: int) -> torch.Tensor:
    """``E_k t``: chunk ``k`` of ``p`` along ``dim`` (a view)."""
    a, b = chunk_range(t.shape[dim], p, k)
    return t.narrow(dim, a, b - a)


def _check_tile(t: torch.Tensor, dim: int, full: int, p: int, k: int, what: str) -> None:
    """A wrong tile length would silently misplace data; fail loudly instead."""
    want = chunk_len(full, p, k)
    if t.shape[dim] != want:
        raise ValueError(
            f"{what}: member {k} of {p} holds {t.shape[dim]} along dim {dim}, but chunk {k} "
            f"of a length-{full} dim has {want} (tiles follow tiling.chunk_range)")


def _check_dims(t: torch.Tensor, src_dim: int, dst_dim: int) -> tuple[int, int]:
    src_dim, dst_dim = src_dim % t.ndim, dst_dim % t.ndim
    if src_dim == dst_dim:
        raise ValueError(f"all_to_all needs two different dims, got {src_dim} twice")
    return src_dim, dst_dim


# ---- threads in one process ------------------------------------------------------


class _Exchange:
    """Shared state of one axis group: one slot per member and a barrier.

    A collective is: post into my slot, wait, read every slot, wait (so nobody
    overwrites a slot that someone still reads).  The barrier's timeout turns a
    rank that never arrives into an error instead of a hang; a barrier broken on
    one member (timeout or :meth:`abort`) wakes every other member at once.
    """

    def __init__(self, size: int, axis: int, timeout_s: float) -> None:
        self.size, self.axis, self.timeout_s = size, axis, timeout_s
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.abort_reason: str | None = None

    def wait(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            if self.abort_reason is not None:
                raise RuntimeError(f"collective on mesh axis {self.axis} aborted: {self.abort_reason}") from None
            raise RuntimeError(
                f"collective on mesh axis {self.axis} timed out after {self.timeout_s:g} s: "
                "a rank died or ranks disagree on the program") from None

    def swap(self, index: int, signature: tuple, payload: Any) -> list[Any]:
        """Post ``payload``, return every member's payload (in member order)."""
        self.slots[index] = (signature, payload)
        self.wait()
        posted = list(self.slots)
        self.wait()
        sigs = {s for s, _ in posted}
        if len(sigs) > 1:  # every member sees the same slots, so all raise together
            raise RuntimeError(
                f"collective on mesh axis {self.axis}: ranks disagree on the program, members called "
                + ", ".join(f"{k}: {s}" for k, (s, _) in enumerate(posted)))
        return [p for _, p in posted]

    def abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.barrier.abort()


class ThreadWorld:
    """Shared state for every axis group of ``mesh``, for ranks run as threads."""

    def __init__(self, mesh: Mesh, timeout_s: float = 60.0) -> None:
        self.mesh, self.timeout_s = mesh, timeout_s
        # (axis, ranks of the group) -> exchange; every rank of a group finds the same one.
        self._exchanges: dict[tuple[int, tuple[int, ...]], _Exchange] = {
            (axis, tuple(g)): _Exchange(len(g), axis, timeout_s)
            for axis in range(mesh.ndim)
            for g in mesh.axis_groups(axis)
        }

    def groups(self, rank: int) -> list[Group]:
        """``rank``'s group on every mesh axis, in axis order."""
        coords = self.mesh.coords(rank)
        return [ThreadGroup(self._exchanges[(axis, tuple(self.mesh.axis_group(rank, axis)))], coords[axis])
                for axis in range(self.mesh.ndim)]

    def abort(self, reason: str) -> None:
        """Wake every rank blocked in (or later entering) a collective with an error."""
        for ex in self._exchanges.values():
            ex.abort(reason)


class ThreadGroup:
    """One member's view of an axis group whose members are threads of this process."""

    def __init__(self, exchange: _Exchange, index: int) -> None:
        self._ex = exchange
        self.size = exchange.size
        self.index = index

    def _swap(self, signature: tuple, t: torch.Tensor) -> list[torch.Tensor]:
        # Share a private copy: the owner may modify its tensor in place afterwards.
        return self._ex.swap(self.index, signature, t.detach().clone())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        # Summing in member order on every member keeps the replicas bitwise equal.
        return functools.reduce(torch.add, self._swap(("all_reduce",), t))

    def all_gather(self, t: torch.Tensor, dim: int, full: int) -> torch.Tensor:
        dim = dim % t.ndim
        _check_tile(t, dim, full, self.size, self.index, "all_gather")
        return torch.cat(self._swap(("all_gather", dim, full), t), dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        dim = dim % t.ndim
        parts = [take_chunk(x, dim, self.size, self.index) for x in self._swap(("reduce_scatter", dim), t)]
        return functools.reduce(torch.add, parts)

    def all_to_all(self, t: torch.Tensor, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
        src_dim, dst_dim = _check_dims(t, src_dim, dst_dim)
        _check_tile(t, src_dim, full_src, self.size, self.index, "all_to_all")
        posted = self._swap(("all_to_all", src_dim, dst_dim, full_src), t)
        return torch.cat([take_chunk(x, dst_dim, self.size, self.index) for x in posted], dim=src_dim)

    def all_to_all_rows(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        if sum(send) != t.shape[0]:
            raise RuntimeError(f"all_to_all_rows on mesh axis {self._ex.axis}: {t.shape[0]} rows, {sum(send)} sent")
        blocks = list(t.detach().clone().split(list(send)))
        posted = self._ex.swap(self.index, ("all_to_all_rows",), blocks)
        got = [posted[j][self.index] for j in range(self.size)]
        if [b.shape[0] for b in got] != list(recv):
            raise RuntimeError(f"all_to_all_rows on mesh axis {self._ex.axis}: member {self.index} expects rows "
                               f"{list(recv)}, the members sent {[b.shape[0] for b in got]}")
        return torch.cat(got)

    def broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        return self._swap(("broadcast", root), t)[root].clone()  # every member gets its own

    def reduce(self, t: torch.Tensor, root: int) -> torch.Tensor:
        total = functools.reduce(torch.add, self._swap(("reduce", root), t))
        return total if self.index == root else torch.zeros_like(t)

    def exchange(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
                 like: torch.Tensor) -> dict[int, torch.Tensor]:
        posted = self._ex.swap(self.index, ("exchange",), {j: t.detach().clone() for j, t in sends.items()})
        out: dict[int, torch.Tensor] = {}
        for j, shape in recv_shapes.items():
            got = posted[j].get(self.index)
            if got is None or tuple(got.shape) != tuple(shape):
                raise RuntimeError(
                    f"exchange on mesh axis {self._ex.axis}: member {self.index} expects {tuple(shape)} from "
                    f"member {j}, which sent {None if got is None else tuple(got.shape)}")
            out[j] = got
        return out


# ---- torch.distributed -------------------------------------------------------------


def wait_in_flight(pending: list[Any]) -> None:
    """Wait for the sums a group still has in flight (``AsyncGroup.in_flight``), at exit.  The last step's sum on a
    rank that never read its loss is still in flight when the script ends: left to the process group's teardown, it
    aborted the process ("terminate called without an active exception", a torchrun restart test that had finished
    every step).  A peer already gone is no error at exit."""
    try:
        while pending:
            pending.pop().wait()
    except Exception:  # the other ranks may have left: nothing to finish
        pending.clear()


class TorchGroup:
    """One member's view of an axis group backed by a ``torch.distributed`` process group.

    The process group's backend is picked per tensor device by torch itself when the
    default group was initialised as ``"cpu:gloo,cuda:nccl"`` (see
    :func:`soybean.runtime.launch.default_backend`); a plain ``"gloo"`` or ``"nccl"``
    group serves only its own device type, which :meth:`_check_device` reports clearly.
    Uneven tiles are padded to the chunk size ``c`` for the fixed-size collectives
    (``all_gather_single``, ``reduce_scatter_single``) and trimmed afterwards;
    ``all_to_all`` sends exact flattened blocks with ``all_to_all_single`` split sizes.
    """

    def __init__(self, pg: Any, index: int | None = None) -> None:
        self.pg = pg
        self.size = dist.get_world_size(pg)
        self.index = dist.get_rank(pg)
        if index is not None and index != self.index:
            raise ValueError(f"group rank {self.index} differs from the expected member index {index}")
        self._backend = str(dist.get_backend(pg)).lower()
        self.in_flight: list[Any] = []  # ``AsyncGroup.in_flight``
        # Registered now, after the process group was made: ``atexit`` runs the later-registered first, so this runs
        # before the group is destroyed (``launch``'s teardown) and before torch's own exit handlers.
        atexit.register(wait_in_flight, self.in_flight)

    def _check_device(self, t: torch.Tensor) -> None:
        dev = t.device.type
        needed = {"cpu": "gloo", "cuda": "nccl"}.get(dev)
        if needed is not None and needed not in self._backend and dev not in self._backend:
            raise RuntimeError(
                f"a {dev} tensor cannot use a {self._backend!r} process group; initialise with "
                f"backend='cpu:gloo,cuda:nccl' (launch.default_backend) or move the tensor")

    def all_reduce_inplace_async(self, t: torch.Tensor) -> Any:
        """Start summing ``t`` in place; returns the work handle (``.wait()`` it before reading ``t``)."""
        self._check_device(t)
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._check_device(t)
        out = t.detach().contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.pg)
        return out

    def broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        self._check_device(t)
        out = t.detach().contiguous().clone()
        dist.broadcast(out, group=self.pg, group_src=root)
        return out

    def reduce(self, t: torch.Tensor, root: int) -> torch.Tensor:
        self._check_device(t)
        out = t.detach().contiguous().clone()
        dist.reduce(out, group=self.pg, group_dst=root, op=dist.ReduceOp.SUM)
        return out if self.index == root else torch.zeros_like(out)

    # Every collective below moves blocks in their natural row-major layout: a tile split along a
    # later dim is packed block by block (long contiguous runs), never transposed by movedim, which
    # on a CPU costs several times the bytes.

    def all_gather(self, t: torch.Tensor, dim: int, full: int) -> torch.Tensor:
        dim = dim % t.ndim
        _check_tile(t, dim, full, self.size, self.index, "all_gather")
        self._check_device(t)
        if full * _numel_without(t, dim) == 0:  # the gathered tensor is empty: nothing to move
            return t.new_empty(_resized(t.shape, {dim: full}))
        c = -(-full // self.size)
        # all_gather_single wants equal sizes: pad my tile to ``c`` along ``dim``.
        x = _pad_dim(t.detach(), dim, c).contiguous()
        n = x.numel()
        out = x.new_empty(self.size * n)
        _all_gather_single(out, x.reshape(-1), group=self.pg)
        blocks = [out[k * n:(k + 1) * n].view(x.shape).narrow(dim, 0, chunk_len(full, self.size, k))
                  for k in range(self.size)]
        return torch.cat(blocks, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        dim = dim % t.ndim
        self._check_device(t)
        n = t.shape[dim]
        mine = chunk_len(n, self.size, self.index)
        if t.numel() == 0:  # empty on every member: nothing to move
            return t.new_zeros(_resized(t.shape, {dim: mine}))
        c = -(-n // self.size)
        # reduce_scatter_single splits its input into equal parts: member k's chunk, padded to
        # ``c`` along ``dim``, is block k.
        shape = _resized(t.shape, {dim: c})
        block = _prod(shape)
        x = t.new_zeros(self.size * block) if n % self.size else t.new_empty(self.size * block)
        for k in range(self.size):
            chunk = take_chunk(t.detach(), dim, self.size, k)
            x[k * block:(k + 1) * block].view(shape).narrow(dim, 0, chunk.shape[dim]).copy_(chunk)
        out = t.new_empty(block)
        _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=self.pg)
        return out.view(shape).narrow(dim, 0, mine).contiguous()

    def all_to_all(self, t: torch.Tensor, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
        src_dim, dst_dim = _check_dims(t, src_dim, dst_dim)
        _check_tile(t, src_dim, full_src, self.size, self.index, "all_to_all")
        self._check_device(t)
        p, n_dst = self.size, t.shape[dst_dim]
        if full_src * _numel_without(t, src_dim) == 0:  # empty on every member: nothing to move
            return t.new_empty(_resized(t.shape, {src_dim: full_src, dst_dim: chunk_len(n_dst, p, self.index)}))
        # Member k gets my block (my src chunk) x (its dst chunk); blocks differ in size, so exact
        # split sizes go along.  When the dst chunks already lie one after another (a contiguous
        # tile split along its leading dim) the tile is sent as it is.
        x = t.detach()
        chunks = [take_chunk(x, dst_dim, p, k) for k in range(p)]
        send_sizes = [c.numel() for c in chunks]
        if x.is_contiguous() and all(s == 1 for s in x.shape[:dst_dim]):
            send = x.reshape(-1)
        else:
            send = x.new_empty(x.numel())
            off = 0
            for c in chunks:
                send[off:off + c.numel()].view(c.shape).copy_(c)
                off += c.numel()
        mine = chunk_len(n_dst, p, self.index)
        recv_shapes = [_resized(t.shape, {src_dim: chunk_len(full_src, p, k), dst_dim: mine}) for k in range(p)]
        recv_sizes = [_prod(r) for r in recv_shapes]
        out = t.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=self.pg)
        return torch.cat([b.view(r) for b, r in zip(out.split(recv_sizes), recv_shapes)], dim=src_dim)


    def all_to_all_rows(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        self._check_device(t)
        row = _prod(t.shape[1:])
        x = t.detach().contiguous().reshape(-1)
        out = t.new_empty(sum(recv) * row)
        dist.all_to_all_single(out, x, output_split_sizes=[r * row for r in recv],
                               input_split_sizes=[n * row for n in send], group=self.pg)
        return out.view(sum(recv), *t.shape[1:])

    def exchange(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
                 like: torch.Tensor) -> dict[int, torch.Tensor]:
        return self.exchange_start(sends, recv_shapes, like).wait()

    def exchange_start(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
                       like: torch.Tensor) -> _Exchanging:
        # Batched asynchronous point-to-point on this axis's own group (peers are group ranks).
        ops, out = [], {}
        for j, t in sends.items():
            self._check_device(t)
            ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), group=self.pg, group_peer=j))
        for j, shape in recv_shapes.items():
            out[j] = like.new_empty(shape)
        for j, buf in out.items():
            ops.append(dist.P2POp(dist.irecv, buf, group=self.pg, group_peer=j))
        return _Exchanging(dist.batch_isend_irecv(ops) if ops else [], out)


class _Exchanging:
    """A started ``TorchGroup.exchange``: its point-to-point works and the buffers they fill."""

    def __init__(self, works: list[Any], out: dict[int, torch.Tensor]) -> None:
        self.works, self.out = works, out

    def wait(self) -> dict[int, torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        return self.out


def _resized(shape: Sequence[int], sizes: dict[int, int]) -> list[int]:
    """``shape`` with the given dims replaced."""
    return [sizes.get(i, s) for i, s in enumerate(shape)]


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _numel_without(t: torch.Tensor, dim: int) -> int:
    return _prod(s for i, s in enumerate(t.shape) if i != dim)


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to ``size``."""
    if x.shape[dim] == size:
        return x
    return torch.cat([x, x.new_zeros(_resized(x.shape, {dim: size - x.shape[dim]}))], dim)


def new_groups(members: Sequence[Sequence[int]], backend: str | None = None) -> list[dist.ProcessGroup | None]:
    """One process group per list of global ranks in ``members``, made by every rank in the same order
    (``dist.new_group`` is collective over the whole world): this rank's group where it is a member, else None.
    ``backend=None`` inherits the default group's backend; a collective waits ``timeouts.group_timeout()``.

    An exchange comes first (``agree.checkpoint``): a rank that failed in work of its own before this call meets
    the others there and every rank raises its error, where they would otherwise wait in ``new_group`` until the
    timeout."""
    from .agree import checkpoint

    checkpoint()
    rank = dist.get_rank()
    made: list[dist.ProcessGroup | None] = []
    for ranks in members:
        g = dist.new_group(ranks=list(ranks), backend=backend, timeout=group_timeout())
        made.append(g if rank in ranks else None)
    return made


def torch_groups(mesh: Mesh, backend: str | None = None, ranks: Sequence[int] | None = None) -> list[TorchGroup]:
    """This rank's :class:`TorchGroup` on every axis of ``mesh``, whose devices are the global ``ranks`` (row-major;
    default: the whole world).  Empty when this rank is not one of them (a pipeline stage of other ranks).

    Every rank creates every group of every axis in the same order (``new_groups``, after its exchange) and keeps
    the ones it belongs to.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = list(range(world)) if ranks is None else list(ranks)
    if len(ranks) != mesh.size:
        raise ValueError(f"mesh {mesh} has {mesh.size} devices but {len(ranks)} ranks were given for it "
                         f"(the world has {world})")
    coords = mesh.coords(ranks.index(rank)) if rank in ranks else None
    axes = [(axis, [ranks[r] for r in local]) for axis in range(mesh.ndim) for local in mesh.axis_groups(axis)]
    made = new_groups([members for _, members in axes], backend)
    # members are sorted by coordinate, so the group rank is my coordinate.
    return [TorchGroup(pg, index=coords[axis]) for (axis, _), pg in zip(axes, made)
            if pg is not None and coords is not None]
