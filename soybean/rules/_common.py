"""Helpers shared by the rule families (registers no rule).

* ``Args`` names an op's arguments by its aten schema and knows which
  ``op.inputs`` slot each tensor argument occupies (pytree flatten order of
  ``(args, kwargs)``), so rules are written in terms of ``"weight"``/``"bias"``
  instead of positions, and absent optional tensors (``bias=None``) drop out.
* ``Args.strategy`` turns ``{role: placement}`` plus output placements into a
  ``Strategy1D`` (unnamed tensors default to ``R``).
* ``bcast`` is NumPy broadcasting seen from one output dim: the input dim that
  carries it (same size) is sharded, a broadcast (size-1 or missing) dim is ``R``.
* ``size_localizer`` builds a ``LocalizeFn`` that rewrites a shape argument to
  the device's local output shape (used by views, expand and factories).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..tiling import Partial, Placement, R, Shard
from .base import LocalizeFn, OpSpec, Strategy1D, TensorSpec, is_float, norm_dim

P = Partial()
Slot = int | list | None
Roles = Mapping[str, Placement | Sequence[Placement]]


def _schema_names(target: Any) -> list[str]:
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _schema_defaults(target: Any) -> dict[str, Any]:
    schema = getattr(target, "_schema", None)
    out: dict[str, Any] = {}
    if schema is not None:
        for a in schema.arguments:
            if a.has_default_value():
                out[a.name] = a.default_value
    return out


class Args:
    """Schema-named arguments of one op (defaults filled in) and their tensor slots."""

    def __init__(self, op: OpSpec) -> None:
        self.op = op
        names = _schema_names(op.target)
        self.values: dict[str, Any] = _schema_defaults(op.target)
        self.slots: dict[str, Slot] = {}
        counter = [0]

        def walk(v: Any) -> Slot:
            if isinstance(v, TensorSpec):
                counter[0] += 1
                return counter[0] - 1
            if isinstance(v, (list, tuple)):
                inner = [walk(x) for x in v]
                return inner if any(s is not None for s in inner) else None
            return None

        for i, v in enumerate(op.args):
            name = names[i] if i < len(names) else f"arg{i}"
            self.values[name] = v
            self.slots[name] = walk(v)
        for k, v in op.kwargs.items():
            self.values[k] = v
            self.slots[k] = walk(v)

    def __getitem__(self, name: str) -> Any:
        return self.values.get(name)

    def spec(self, name: str) -> TensorSpec | None:
        v = self.values.get(name)
        return v if isinstance(v, TensorSpec) else None

    def tensor(self, name: str) -> TensorSpec:
        """Tensor argument ``name``, which the op's schema requires."""
        v = self.spec(name)
        if v is None:
            raise ValueError(f"{self.op.name}: tensor argument {name!r} is missing")
        return v

    def dim(self, of: str = "self", arg: str = "dim") -> int:
        """Argument ``arg`` as a non-negative dim of tensor argument ``of`` (a 0-d tensor counts as 1-d)."""
        return norm_dim(self[arg], max(self.tensor(of).ndim, 1))

    def idx(self, name: str) -> int:
        """Index of tensor argument ``name`` in ``inputs + outputs`` (for ``even``)."""
        s = self.slots.get(name)
        if not isinstance(s, int):
            raise KeyError(f"{self.op.name}: no tensor argument {name!r}")
        return s

    def out_idx(self, j: int = 0) -> int:
        """Index of output ``j`` in ``inputs + outputs``."""
        return len(self.op.inputs) + j

    def strategy(
        self, roles: Roles, outs: Sequence[Placement] | Placement, even: Iterable[tuple[int, ...]] = ()
    ) -> Strategy1D:
        """``Strategy1D`` from ``{argument name: placement(s)}``; absent tensors are skipped."""
        ins: list[Placement] = [R] * len(self.op.inputs)
        for name, pl in roles.items():
            slot = self.slots.get(name)
            if slot is None:
                continue
            if isinstance(slot, int):
                ins[slot] = pl  # type: ignore[assignment]
            else:
                pls = pl if isinstance(pl, (list, tuple)) else [pl] * len(slot)
                for s, p in zip(slot, pls):
                    if s is not None:
                        ins[s] = p
        if not isinstance(outs, Sequence):  # one placement for every output
            outs = [outs] * len(self.op.outputs)
        return Strategy1D(tuple(ins), tuple(outs), frozenset(even))

    def all_float(self, *names: str) -> bool:
        """Every named tensor argument that is present is floating point (so may be ``P``)."""
        for n in names:
            slot = self.slots.get(n)
            if slot is None:
                continue
            for s in (slot if isinstance(slot, list) else [slot]):
                if s is not None and not is_float(self.op.inputs[s]):
                    return False
        return True


def outputs_float(op: OpSpec) -> bool:
    return all(is_float(o) for o in op.outputs)


def bcast(spec: TensorSpec | None, out_shape: Sequence[int], d: int) -> Placement:
    """Placement of a broadcasting input when output dim ``d`` is sharded."""
    if spec is None:
        return R
    j = d - (len(out_shape) - spec.ndim)
    # A data-dependent dim is taken to carry the output dim whatever its priced size: ``Shard`` there is then dropped
    # (``base.splits_dynamic``) rather than ``R`` assumed a broadcast the run-time size may not be.
    if j >= 0 and (spec.shape[j] == out_shape[d] or j in spec.dynamic):
        return Shard(j)
    return R


def free_placements(spec: TensorSpec | None) -> list[Placement]:
    """Every placement of a tensor whose values an op ignores (only its dtype/device matter)."""
    if spec is None:
        return [R]
    return [R, *(Shard(d) for d in range(spec.ndim)), *([P] if is_float(spec) else [])]


def dims_arg(v: Any, ndim: int) -> list[int]:
    """A ``dim`` argument (int, list, ``None``/``[]`` meaning all) as sorted non-negative dims."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return list(range(ndim))
    if isinstance(v, int):
        v = [v]
    return sorted({norm_dim(int(d), max(ndim, 1)) for d in v})


def set_arg(op: OpSpec, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """Replace argument ``name`` (positional or keyword) in a call's ``args``/``kwargs``."""
    names = _schema_names(op.target)
    pos = names.index(name) if name in names else -1
    if 0 <= pos < len(args):
        args = tuple(value if i == pos else a for i, a in enumerate(args))
    else:
        kwargs = {**kwargs, name: value}
    return args, kwargs


def get_arg(op: OpSpec, args: tuple, kwargs: dict, name: str) -> Any:
    """Argument ``name`` (positional or keyword) of a call's ``args``/``kwargs`` (``set_arg``'s reader)."""
    names = _schema_names(op.target)
    pos = names.index(name) if name in names else -1
    return args[pos] if 0 <= pos < len(args) else kwargs.get(name)


def size_localizer(name: str, pick: Callable[[OpSpec, Sequence[int]], list[int]] | None = None) -> LocalizeFn:
    """``LocalizeFn`` setting shape argument ``name`` to the local output shape.

    ``pick(op, local_out_shape)`` selects the part of the shape the argument
    describes (default: all of it).  Replacing the whole list also removes ``-1``.
    """

    def localize(
        op: OpSpec,
        args: tuple,
        kwargs: dict,
        in_shapes: Sequence[tuple[int, ...]],
        out_shapes: Sequence[tuple[int, ...]],
    ) -> tuple:
        shape = list(out_shapes[0])
        local: list[Any] = pick(op, shape) if pick else shape
        if op.outputs[0].dynamic:
            # Its shape holds only priced sizes, and a data-dependent dim is never split (``base.splits_dynamic``):
            # every entry this tile does not cut keeps the argument's own (``-1``, the run-time size's node).
            whole = list(op.outputs[0].shape)
            given = list(get_arg(op, args, kwargs, name))
            local = [g if n == w else n for g, n, w in zip(given, local, pick(op, whole) if pick else whole)]
        return set_arg(op, args, kwargs, name, local)

    return localize


def partial_strategies(a: Args, groups: Iterable[Iterable[str]]) -> list[Strategy1D]:
    """``P`` on each group of (float) arguments, ``R`` elsewhere, ``P`` out: the op is linear in the group."""
    out: list[Strategy1D] = []
    if not outputs_float(a.op):
        return out
    for g in groups:
        names = [n for n in g if a.slots.get(n) is not None]
        if names and a.all_float(*names):
            out.append(a.strategy({n: P for n in names}, P))
    return out


__all__ = [
    "Args", "P", "R", "Shard", "bcast", "free_placements", "dims_arg", "set_arg", "size_localizer",
    "partial_strategies", "outputs_float", "norm_dim", "is_float",
]
