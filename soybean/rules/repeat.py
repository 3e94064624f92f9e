"""Repetition: ``repeat`` (tiles the whole tensor) and ``repeat_interleave`` (repeats each element).

``repeat(x, r)``: ``out`` has ``len(r)`` dims (new ones in front); along output dim ``o`` (input dim
``d = o - (len(r) - x.ndim)``, if any) ``out[j] = x[j mod n]`` for ``j < r_o n``.

* a dim repeated once maps to itself: ``S(d) -> S(o)``;
* a repeated dim (or a new one) may be split on the output alone, ``x`` whole, when the split divides the
  repeat count: every device's output chunk is then ``r_o / p`` whole copies of ``x`` along that dim (``even``
  with the input's length as the unit);
* linear: ``P -> P``.

``repeat_interleave(x, r, dim)`` (an int ``r``): along ``dim``, ``out[i r + k] = x[i]``.  Other dims split
freely; ``dim`` itself splits when it splits evenly (both sides ``even``): device ``k``'s ``n/p`` elements
make exactly its ``r n / p`` output rows.  Without ``dim`` the input is flattened first (a reshape: only
``P``).  Linear.  The rotary embeddings of GPT-J, CodeGen, Cohere and GLM interleave their tables this way.

``localize`` rewrites the repeat counts (and ``output_size``) to the device's tiles.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..tiling import Placement
from ._common import Args, R, Shard, norm_dim, partial_strategies, set_arg
from .base import ELEMENTWISE, OpSpec, Strategy1D, register


@register("aten.repeat.default", family="repeat", cost=ELEMENTWISE,
          localize=lambda op, a, k, ins, outs: set_arg(op, a, k, "repeats", _local_repeats(ins[0], outs[0])))
def repeat(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    reps = list(a["repeats"])
    new = len(reps) - x.ndim
    out = op.outputs[0].shape
    found: list[Strategy1D] = []
    for o, r in enumerate(reps):
        d = o - new
        if r == 1 and d >= 0:
            found.append(a.strategy({"self": Shard(d)}, Shard(o)))
        elif r > 1 and out[o]:
            # whole copies per device: the output splits along ``o`` into whole units of the input's length
            unit = x.shape[d] if d >= 0 else 1
            found.append(Strategy1D(_replicated(a), (Shard(o),), frozenset({(a.out_idx(), o, unit)})))
    return found + partial_strategies(a, [["self"]])


def _replicated(a: Args) -> tuple[Placement, ...]:
    return tuple(R for _ in a.op.inputs)


def _local_repeats(local_in: Sequence[int], local_out: Sequence[int]) -> list[int]:
    """The repeat counts that make the local output from the local input (dims aligned on the right)."""
    new = len(local_out) - len(local_in)
    return [n if o < new else (n // local_in[o - new] if local_in[o - new] else 1) for o, n in enumerate(local_out)]


def _interleave_dim(a: Args) -> int | None:
    x = a.tensor("self")
    return None if a["dim"] is None else norm_dim(a["dim"], max(x.ndim, 1))


def _localize_interleave(op: OpSpec, args: tuple, kwargs: dict, ins: Sequence[tuple[int, ...]],
                         outs: Sequence[tuple[int, ...]]) -> tuple:
    """``output_size`` (when given) is the local output's length along ``dim``."""
    a = Args(op)
    dim = _interleave_dim(a)
    if a["output_size"] is None or dim is None:
        return args, kwargs
    return set_arg(op, args, kwargs, "output_size", outs[0][dim])


@register("aten.repeat_interleave.self_int", family="repeat", cost=ELEMENTWISE, localize=_localize_interleave)
def repeat_interleave(op: OpSpec) -> list[Strategy1D]:
    a = Args(op)
    x = a.tensor("self")
    dim = _interleave_dim(a)
    found: list[Strategy1D] = []
    if dim is not None:
        for d in range(x.ndim):
            even = [(a.idx("self"), d), (a.out_idx(), d)] if d == dim else []
            found.append(a.strategy({"self": Shard(d)}, Shard(d), even))
    return found + partial_strategies(a, [["self"]])


