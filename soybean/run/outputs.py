"""Outputs as a training loop meets them: split outputs are not gathered until something needs them whole.

A plan leaves a non-scalar output in some tiling (data parallelism: ``S(0)``, split along the batch).  The
full-batch contract promises the caller the whole output on every rank, which costs an all-gather of it per
step, although a loop that computes its loss outside the model (``loss = loss_fn(pmodel(x), y)``) needs only
the loss.  So a split output is returned as a ``LazyFull``: this rank's tile, with its tiling.

* A loss of ``torch.nn.functional`` (``LOSSES``: ``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss``,
  ``cross_entropy``, ``nll_loss``, ``binary_cross_entropy_with_logits``) applied to it with a full target and
  ``reduction`` ``mean`` or ``sum`` is computed on the tile against the target's matching tile and summed over
  the split mesh axes: only the scalar moves.  With ``T_k`` the tiles of the batch, a sum loss is
  ``sum_k l(T_k)``, one all-reduce (``P -> R``, whose adjoint hands every member the replicated gradient 1;
  started asynchronously, its sum arriving while backward runs, ``runtime.pending``), and a mean divides each
  tile's sum by the count the full target gives (its element count; ``cross_entropy`` / ``nll_loss``:
  the targets not ignored, with class weights their summed weight), so the value and every gradient equal the
  serial loss's.
* Anything else (an op, a method, an attribute that needs the values, ``torch.Tensor`` arithmetic) gathers
  the tile into the full tensor first (the plan's own all-gather, differentiable: under the full-batch
  contract every rank computes the same thing from it, so the gradient is replicated and its adjoint is the
  slice) and proceeds on that, once per output: the whole output, as before, paid only when read.
  ``shape``, ``dtype``, ``device``, ``ndim``, ``dim()``, ``size()`` and ``numel()`` need no gather.
* The whole output's ``sum()`` and ``mean()`` (``torch.sum``/``torch.mean`` too, over every element) are the
  tile's sum all-reduced over the axes that split it, divided by the element count for a mean: one scalar
  moves, and the all-reduce's adjoint hands every tile the gradient 1 (or ``1 / numel``), the serial one.
  A cast before them (``float()``, ``double()``, ``half()``, ``bfloat16()``, ``to(dtype)``) casts the tile and
  stays lazy, so a loop's ``out.float().sum()`` never gathers.
* Views that keep the tiles batch slices stay lazy too (where the output is split along dim 0 only; an output
  split along another dim, vocabulary-split logits, gathers for them), so a Hugging Face loss (``logits.float()``,
  ``logits.view(-1, vocab)``, ``cross_entropy`` against the flattened labels) and a loop's shift
  (``logits[..., :-1, :].contiguous()``) gather nothing: ``view``/``reshape``/``flatten`` that merge dim 0 with
  the dims after it (the rows of tile ``k`` become ``unit`` consecutive rows each, ``unit`` the product of the
  merged dims: exact for uneven tiles too, since a target is cut in the same units), indexing that leaves dim 0
  whole (slices and integers on the other dims: each tile's own rows), and ``contiguous()``.

A ``LazyFull`` is not a ``torch.Tensor`` (``isinstance`` is False); ``.full()`` gives the tensor, ``.local``
the tile.  ``parallelize(..., outputs="full")`` returns full tensors as before.

Under the local-batch contract (``local_batch=True``, DDP's) each rank gets its own tile and computes its loss
on it, a mean over its slice; DDP's training is the mean over ranks of those losses.  ``local_mean`` gives a
tile output that gradient: the identity, whose backward scales by ``1 / n`` for ``n`` the distinct tiles (the
product of the sizes of the mesh axes that split it), so the summed gradient sync yields DDP's average.
"""
from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.utils._pytree import tree_map

from ..codegen.lower import gather_now
from ..ir.losses import mean_count
from ..mesh import Mesh
from ..runtime.collectives import all_reduce
from ..runtime.comm import Group
from ..runtime.context import use_groups
from ..runtime.pending import all_reduce_lazy
from ..tiling import Placement, Shard, local_tile

# The losses computed tile by tile: each with how to count a mean's denominator from the full target
# (``None``: the input's element count).
LOSSES: dict[Callable[..., Any], str] = {
    F.mse_loss: "numel", F.l1_loss: "numel", F.smooth_l1_loss: "numel", F.huber_loss: "numel",
    F.binary_cross_entropy_with_logits: "numel", F.cross_entropy: "classes", F.nll_loss: "classes",
}


class _LocalMean(Function):
    """Identity forward; backward scales the gradient by ``factor`` (``1 / n`` tiles: ``local_mean``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g * ctx.factor, None


def split_count(tiling: Sequence[Placement], mesh: Mesh) -> int:
    """How many distinct tiles a tiling makes: the product of the sizes of the axes that shard it."""
    return math.prod(n for p, n in zip(tiling, mesh.shape) if isinstance(p, Shard))


def local_mean(tile: torch.Tensor, tiling: Sequence[Placement], mesh: Mesh) -> torch.Tensor:
    """The local-batch contract's output (module docstring): ``tile``, whose gradient is scaled by ``1 / n``."""
    n = split_count(tiling, mesh)
    return _LocalMean.apply(tile, 1.0 / n) if n > 1 and tile.requires_grad else tile


class LazyFull:
    """A split output, gathered on first full read (module docstring)."""

    def __init__(self, tile: torch.Tensor, tiling: tuple, shape: tuple[int, ...], mesh: Mesh,
                 coords: tuple[int, ...], groups: Sequence[Group], unit: int = 1) -> None:
        self.local, self.tiling, self._shape = tile, tiling, torch.Size(shape)
        self._mesh, self._coords, self._groups = mesh, coords, list(groups)
        # Rows of dim 0 per row of the tiled batch (a view merged dim 0 with the dims after it): the tiling cuts
        # ``shape[0] // unit`` rows, each tile's rows are ``unit`` consecutive rows per batch row it holds.
        self._unit = unit
        self._full: torch.Tensor | None = None

    def _like(self, tile: torch.Tensor, shape: Sequence[int] | None = None, unit: int | None = None) -> LazyFull:
        """Another split output tiled as this one: ``tile`` with the full ``shape`` and ``unit`` (default ours)."""
        return LazyFull(tile, self.tiling, tuple(self._shape if shape is None else shape), self._mesh, self._coords,
                        self._groups, self._unit if unit is None else unit)

    def _batch_view(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (this output's shape, or its tile's) seen with the tiled batch as dim 0 and ``unit`` after it."""
        return x.reshape(-1, self._unit, *x.shape[1:]) if self._unit > 1 else x

    # ---- what needs no values ----
    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def requires_grad(self) -> bool:
        return self.local.requires_grad

    def dim(self) -> int:
        return len(self._shape)

    def size(self, d: int | None = None) -> Any:
        return self._shape if d is None else self._shape[d]

    def numel(self) -> int:
        return math.prod(self._shape)

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        return f"LazyFull(shape={tuple(self._shape)}, tiling={'/'.join(map(str, self.tiling))}, local={self.local!r})"

    # ---- the whole tensor ----
    def full(self) -> torch.Tensor:
        """The whole output (differentiable), gathered once."""
        if self._full is None:
            whole = (self._shape[0] // self._unit, self._unit, *self._shape[1:]) if self._unit > 1 else self._shape
            with use_groups(self._groups):
                self._full = gather_now(self._batch_view(self.local), self.tiling, tuple(whole), self._mesh,
                                        self._coords).reshape(self._shape)
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") and name not in ("__array__",):
            raise AttributeError(name)
        return getattr(self.full(), name)

    def __getitem__(self, idx: Any) -> Any:
        """Indexing that leaves dim 0 whole (a leading ``...`` or ``:``, then slices and integers) is each tile's
        own, where the tiles are batch slices; anything else is the full tensor's (an output split along another
        dim, as MobileBERT's vocabulary-split logits are: its tile's ``[..., :100]`` is not the full's)."""
        if self._batch_split() and _keeps_rows(idx, self.ndim):
            return self._like(self.local[idx], torch.empty(self._shape, device="meta")[idx].shape)
        return self.full()[idx]

    # ---- views that keep the tiles batch slices ----
    def view(self, *shape: Any) -> Any:
        """A view merging dim 0 with the dims after it (``view(-1, vocab)``) stays lazy where the tiles are batch
        slices; any other, and any view of an output split along another dim, the full's."""
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if self._batch_split() and dims and all(isinstance(d, int) for d in dims):
            rest = tuple(dims[1:])
            lead = self.numel() // max(math.prod(rest), 1) if dims[0] == -1 else dims[0]
            j = _merged_lead(tuple(self._shape), (lead, *rest))
            if j is not None:
                unit = self._unit * math.prod(self._shape[1:j + 1])
                return self._like(self.local.reshape(-1, *rest), (lead, *rest), unit)
        return self.full().view(*shape)

    def reshape(self, *shape: Any) -> Any:
        """As ``view`` (a reshape merging dim 0 with the dims after it stays lazy)."""
        return self.view(*shape)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Any:
        """``flatten`` from dim 0 stays lazy (a ``view`` merging dims 0..end_dim); from another dim, the full's."""
        if start_dim != 0:
            return self.full().flatten(start_dim, end_dim)
        end = end_dim % self.ndim if self.ndim else 0
        return self.view(math.prod(self._shape[:end + 1]), *self._shape[end + 1:])

    def contiguous(self, *args: Any, **kwargs: Any) -> LazyFull:
        return self._like(self.local.contiguous(*args, **kwargs))

    def __iter__(self) -> Any:
        return iter(self.full())

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.sum, torch.mean) and len(args) == 1 and isinstance(args[0], LazyFull):
            return getattr(args[0], func.__name__)(**kwargs)
        if func in LOSSES and args and isinstance(args[0], LazyFull):
            out = args[0]._loss(func, args[1:], kwargs)
            if out is not None:
                return out

        def whole(a: Any) -> Any:
            return a.full() if isinstance(a, LazyFull) else a

        return func(*tree_map(whole, args), **tree_map(whole, kwargs))

    # ---- casts and whole reductions, tile by tile ----
    def _cast(self, dtype: torch.dtype) -> LazyFull:
        """The same split output in ``dtype`` (elementwise: the tile's cast, tiled the same way)."""
        out = self._like(self.local.to(dtype))
        if self._full is not None:
            out._full = self._full.to(dtype)
        return out

    def float(self) -> LazyFull:
        return self._cast(torch.float32)

    def double(self) -> LazyFull:
        return self._cast(torch.float64)

    def half(self) -> LazyFull:
        return self._cast(torch.float16)

    def bfloat16(self) -> LazyFull:
        return self._cast(torch.bfloat16)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``to(dtype)`` stays lazy; a device or anything else is the full tensor's ``to``."""
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.dtype):
            return self._cast(args[0])
        if not args and set(kwargs) == {"dtype"}:
            return self._cast(kwargs["dtype"])
        return self.full().to(*args, **kwargs)

    def sum(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The sum of every element (``dtype=`` allowed): the tiles' sums summed; with a dim, the full tensor's."""
        if args or set(kwargs) - {"dtype"}:
            return self.full().sum(*args, **kwargs)
        return self._summed(self.local.sum(**kwargs))

    def mean(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The mean of every element: the whole sum over the element count; with a dim, the full tensor's."""
        if args or set(kwargs) - {"dtype"}:
            return self.full().mean(*args, **kwargs)
        # Scaled first, so the sum is the last step (the pending sum stays the value returned).
        return self._cast(kwargs.get("dtype", self.dtype))._scaled(1.0 / self.numel()).sum()

    def _scaled(self, factor: builtins.float) -> LazyFull:
        return self._like(self.local * factor)

    # ---- a loss, tile by tile ----
    def _batch_split(self) -> bool:
        """Split along dim 0 only (by any number of axes): the tiles are batch slices."""
        shards = [p for p in self.tiling if isinstance(p, Shard)]
        return bool(shards) and all(p.dim == 0 for p in shards)

    def _loss(self, func: Callable[..., Any], rest: tuple, kwargs: dict) -> torch.Tensor | None:
        """``func(self, *rest, **kwargs)`` computed on the tile, or None where the fast path does not apply."""
        # ``handle_torch_function`` passes every keyword, the deprecated ones as None.
        kw = {k: v for k, v in kwargs.items() if not (k in ("size_average", "reduce") and v is None)}
        target = rest[0] if rest else kw.pop("target", None)
        extra = rest[1:]
        reduction = kw.pop("reduction", "mean")
        if extra or not self._batch_split() or reduction not in ("mean", "sum") or "size_average" in kw \
                or "reduce" in kw or not isinstance(target, torch.Tensor) or isinstance(target, LazyFull):
            return None
        if target.dim() == 0 or target.shape[0] != self._shape[0]:
            return None
        kind = LOSSES[func]
        if kind == "numel" and target.shape != self._shape:
            return None  # broadcasting targets: the whole path
        if kw.get("pos_weight") is not None or (kind == "numel" and kw.get("weight") is not None):
            return None  # per-element weights would need tiling too
        # a target needs no copy; cut in the batch's units, as the tiles are
        mine = local_tile(self._batch_view(target), self.tiling, self._mesh, self._coords, copy=False)
        mine = mine.reshape(-1, *target.shape[1:]) if self._unit > 1 else mine
        part = func(self.local, mine, reduction="sum", **kw)
        if reduction == "mean":  # (sum_k s_k) / c = sum_k (s_k / c): scaled first, so the sum is the last step
            part = part / mean_count(kind, self.numel(), target, kw)
        return self._summed(part)

    def _summed(self, part: torch.Tensor) -> torch.Tensor:
        """A scalar computed on this tile, summed over the mesh axes that split the output."""
        axes = [a for a, p in enumerate(self.tiling) if isinstance(p, Shard) and self._mesh.shape[a] > 1]
        for a in axes[:-1]:
            part = all_reduce(part, self._groups[a])
        # The last sum arrives while backward runs, as the loss a model returns does (``runtime.pending``).
        return all_reduce_lazy(part, self._groups[axes[-1]]) if axes else part


def _keeps_rows(idx: Any, ndim: int) -> bool:
    """Whether index ``idx`` of a tensor of ``ndim`` dims leaves dim 0 whole and indexes the others by slices and
    integers only: ``x[:, 1:]``, ``x[..., :-1, :]``, ``x[:, 0]`` (not ``x[0]``, ``x[None]``, ``x[mask]``)."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    if not parts or ndim == 0 or any(p is None or not isinstance(p, (slice, int, type(Ellipsis))) for p in parts):
        return False
    if sum(p is Ellipsis for p in parts) > 1:
        return False
    explicit = sum(p is not Ellipsis for p in parts)
    first = parts[0]
    if first is Ellipsis:  # it covers dim 0 when it covers any dim
        return ndim - explicit >= 1
    return isinstance(first, slice) and first == slice(None)


def _merged_lead(shape: tuple[int, ...], new: tuple[int, ...]) -> int | None:
    """``j`` when ``new`` is ``shape`` with dims ``0..j`` merged into one (the others as they were), else None."""
    for j in range(len(shape)):
        if math.prod(shape[:j + 1]) == new[0] and tuple(shape[j + 1:]) == tuple(new[1:]):
            return j
    return None


def _forward(name: str) -> Callable[..., Any]:
    def method(self: LazyFull, *args: Any) -> Any:
        return getattr(self.full(), name)(*(a.full() if isinstance(a, LazyFull) else a for a in args))

    method.__name__ = name
    return method


# Operators look their methods up on the type, not through ``__getattr__``: each is the full tensor's.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__",
              "__neg__", "__pos__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__and__", "__or__", "__xor__", "__invert__", "__float__", "__int__", "__bool__", "__array__"):
    setattr(LazyFull, _name, _forward(_name))
LazyFull.__hash__ = object.__hash__  # type: ignore[method-assign]  # ``__eq__`` compares values; identity hashes


def lazy_outputs(out: Any, tilings: Sequence[tuple | None], shapes: Sequence[tuple[int, ...]], mesh: Mesh,
                 coords: tuple[int, ...], groups: Sequence[Group]) -> list[Any]:
    """The program's flat outputs with each split one (``tilings[i]`` not None) wrapped as a ``LazyFull``."""
    return [LazyFull(o, t, s, mesh, coords, groups) if t is not None and isinstance(o, torch.Tensor) else o
            for o, t, s in zip(out, tilings, shapes)]
