"""Which inputs an op writes in place: its schema's ``Tensor(a!)`` arguments and the hidden writes its rule
declares (``register(..., writes=...)``: batch norm's running statistics in training)."""
from __future__ import annotations

from typing import Any

from .. import rules
from ..rules._common import Args
from ..rules.base import OpSpec


def _schema_writes(target: Any) -> list[str]:
    """The names of ``target``'s ``Tensor(a!)`` arguments."""
    schema = getattr(target, "_schema", None)
    return [x.name for x in schema.arguments if x.alias_info is not None and x.alias_info.is_write] if schema else []


def may_write(target: Any) -> bool:
    """Whether an op of ``target`` can write an input in place (``written_inputs`` non-empty for some call): its
    schema has a ``Tensor(a!)`` argument or its rule declares writes.  False lets a caller skip building the op."""
    entry = rules.lookup(target)
    return bool(_schema_writes(target)) or (entry is not None and entry.writes is not None)


def written_inputs(op: OpSpec) -> list[int]:
    """Indices into ``op.inputs`` of the tensors the op writes in place (none, without parsing the op's arguments,
    for an op that cannot write: ``may_write``)."""
    names = _schema_writes(op.target)
    entry = rules.lookup(op.target)
    if entry is not None and entry.writes is not None:
        names += entry.writes(op)
    if not names:
        return []
    a = Args(op)
    return [slot for n in names if isinstance(slot := a.slots.get(n), int)]
