"""Resharding: the collective steps that turn one tiling into another.

One function, ``plan_reshard``, decides the steps; the cost model prices them and
codegen emits them, so what is priced is what runs.  Steps act on one mesh axis; their
kinds (placement change, collective, adjoint, runtime call) are the entries of
``ir.kinds.KINDS``.

Nesting rule: with DTensor chunking, axis ``i`` cuts the chunk left by axes
``< i``.  So an axis may gather or slice dim ``d`` only when no later axis
shards ``d`` at that moment.  Axes that would break this are gathered first and
sliced again afterwards (unsharding goes inner -> outer, sharding outer -> inner).

``partial_grad_axes``: axes on which the consumer splits its work while taking
this input replicated: each device's gradient is then a partial sum that must be
all-reduced (fused into the gather as a reduce-scatter when there is one).

``src_partial_axes``: axes on which the *source* (a shared resharding point,
see ``graph``) collects partial gradients and reduces them once for all its
consumers.  A consumer that already returns a partial gradient there passes it
through; one that returns a full gradient gets ``grad_to_partial`` (free) so
the sum stays right.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from .ir.kinds import KINDS, Step, apply_step
from .tiling import Partial, Placement, R, Replicate, Shard

__all__ = ["Route", "Step", "apply_step", "plan_reshard"]

Tiling = tuple[Placement, ...]


@dataclass(frozen=True)
class Route:
    """How one use of a value travels: from its source's tiling ``src`` to the tiling ``dst`` its
    consumer reads.  ``graph`` decides every field once; the cost model prices ``steps()`` and
    codegen emits them, so what is priced is what runs.

    ``partial_grad_axes`` and ``src_partial_axes`` (see the module docstring) only matter when
    the value ``needs_grad``; otherwise they are empty.  Both are sorted and distinct: make routes with ``of``.
    """

    src: Tiling
    dst: Tiling
    partial_grad_axes: tuple[int, ...] = ()
    src_partial_axes: tuple[int, ...] = ()
    needs_grad: bool = False
    # Routes key the pricing caches, hashed millions of times while a large model is planned.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (self.src, self.dst, self.partial_grad_axes, self.src_partial_axes, self.needs_grad)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # Rebuilt, not copied: the cached hash is this process's (placements hash by identity).
        return (Route, (self.src, self.dst, self.partial_grad_axes, self.src_partial_axes, self.needs_grad))

    @staticmethod
    @lru_cache(maxsize=400_000)
    def of(src: Tiling, dst: Tiling, partial_grad_axes: tuple[int, ...] = (), src_partial_axes: tuple[int, ...] = (),
           needs_grad: bool = False) -> Route:
        """The route, with the gradient-only fields dropped when nothing needs a gradient.

        Cached, one object per distinct route (the planner asks for hundreds of thousands), so the
        arguments are tuples."""
        if not needs_grad:
            return Route(src, dst)
        return Route(src, dst, tuple(sorted(set(partial_grad_axes))), tuple(sorted(set(src_partial_axes))), True)

    def steps(self) -> list[Step]:
        """The steps of this route, forward order (its axes already sorted and distinct: ``of``)."""
        return list(self.planned())

    def planned(self) -> tuple[Step, ...]:
        """``steps``, as the planner's cache holds them (shared: never to be changed)."""
        return _plan_cached(self.src, self.dst, self.partial_grad_axes, self.src_partial_axes)

    def walk(self) -> tuple[Walked, ...]:
        """Every step with the tilings around it and the collectives it runs: the one walk of a route that
        pricing (``cost.collectives.priced_steps``, ``route_calls``), the plan's records and code emission
        (``codegen.lower.emit_reshard``) all read."""
        return _walk(self)


# Named tuples, not dataclasses: a large model's planning walks hundreds of thousands of routes once each.
class StepCall(NamedTuple):
    """One collective a step runs: ``collective`` (a ``RING_FACTOR`` key), in backward or not, the tiling whose
    local tile is its message, and whether it is the gradient sync (the kinds table's ``gradient_sync``)."""

    collective: str
    backward: bool
    message: Tiling
    sync: bool

    @property
    def phase(self) -> str:
        """``forward`` or ``backward``, as plans name a collective's phase (``Plan.reshards``)."""
        return phase(self.backward)


def phase(backward: bool) -> str:
    """How plans name the phase a collective runs in."""
    return "backward" if backward else "forward"


class Walked(NamedTuple):
    """A route's step, the tilings before and after it, and its collectives: the forward one, then (when the
    value needs a gradient) its adjoint; a step with neither is local (a slice, ``to_partial``)."""

    step: Step
    before: Tiling
    after: Tiling
    calls: tuple[StepCall, ...]


def _walk(route: Route) -> tuple[Walked, ...]:
    out = []
    cur = route.src
    for step in route.planned():
        w = walk_step(cur, step, route.needs_grad)
        out.append(w)
        cur = w.after
    return tuple(out)


@lru_cache(maxsize=1 << 16)
def walk_step(cur: Tiling, step: Step, grad: bool) -> Walked:
    """One step of a walk from tiling ``cur``: a cold mesh shape walks ~140 thousand routes, which share far
    fewer steps."""
    # ``tuple.__new__``: a named tuple made without its Python-level constructor.
    new = tuple.__new__
    kind = KINDS[step.kind]
    nxt = apply_step(cur, step)
    calls = []
    f = kind.forward
    if f is not None:
        calls.append(new(StepCall, (f.collective, False, nxt if f.message == "after" else cur, False)))
    if grad and (b := kind.adjoint(step)) is not None:
        calls.append(new(StepCall, (b.collective, True, nxt if b.message == "after" else cur, kind.gradient_sync)))
    return new(Walked, (step, cur, nxt, tuple(calls)))


def plan_reshard(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    partial_grad_axes: Sequence[int] = (),
    src_partial_axes: Sequence[int] = (),
) -> list[Step]:
    """Steps from tiling ``src`` to ``dst`` (forward order)."""
    return list(_plan_cached(
        tuple(src), tuple(dst), tuple(sorted(set(partial_grad_axes))), tuple(sorted(set(src_partial_axes)))
    ))


# A cold three-axis mesh plans ~140 thousand distinct routes: a smaller cache evicted routes still to be met again.
@lru_cache(maxsize=1 << 19)
def _plan_cached(src: tuple, dst: tuple, partial_grad_axes: tuple, src_partial_axes: tuple) -> tuple[Step, ...]:
    """``plan_reshard`` with its axes sorted and distinct."""
    n = len(src)
    if len(dst) != n:
        raise ValueError(f"tilings of different mesh rank: {src} vs {dst}")
    pga = set(partial_grad_axes)
    first: list[Step] = []
    for a in src_partial_axes:
        if a in pga and isinstance(dst[a], Replicate) and isinstance(src[a], Replicate):
            pga.discard(a)  # the consumer's partial gradient is reduced at the source, once
        else:
            first.append(_step("grad_to_partial", a))
    return tuple(first + _plan(src, dst, sorted(pga)))


def _plan(src: tuple, dst: tuple, partial_grad_axes: Sequence[int]) -> list[Step]:
    steps = list(_moves(src, dst))
    for i in partial_grad_axes:  # phase 3: partial gradients of replicated inputs (sorted, distinct)
        if not isinstance(dst[i], Replicate):
            continue
        gathers = [k for k, s in enumerate(steps) if s.axis == i and s.kind == "all_gather"]
        if gathers:
            g = steps[gathers[-1]]
            steps[gathers[-1]] = _step("all_gather", g.axis, g.dim, -1, True)
        else:
            steps.append(_step("grad_all_reduce", i))
    return steps


@lru_cache(maxsize=1 << 18)
def _moves(src: tuple, dst: tuple) -> tuple[Step, ...]:
    """The steps from ``src`` to ``dst`` before any partial gradient is placed (phases 1 and 2): the same for every
    set of partial-gradient axes, so a route's variants share them (a cold three-axis mesh plans ~140 thousand
    routes over ~94 thousand pairs of tilings)."""
    # Placements are interned, so ``is`` compares them; each axis's sharded dim (-1: none) is read as an int.
    n = len(src)
    sd = [p.dim if p.__class__ is Shard else -1 for p in src]
    dd = [p.dim if p.__class__ is Shard else -1 for p in dst]
    reset = [src[i] is not dst[i] for i in range(n)]
    changed = True
    while changed:  # axes inside a reset axis that shard the same dim must be reset too
        changed = False
        for i in range(n):
            if not reset[i] or (sd[i] < 0 and dd[i] < 0):
                continue
            dims = {d for d in (sd[i], dd[i]) if d >= 0}
            for j in range(i + 1, n):
                if not reset[j] and (sd[j] in dims or dd[j] in dims):
                    reset[j] = changed = True
    # How many axes shard each dim in ``src`` or ``dst``: a dim an axis moves is sharded elsewhere when another
    # axis counts too (the axis itself always does), read once here rather than per question (~94k pairs a mesh).
    axes_on: dict[int, int] = {}
    for i in range(n):
        for d in {sd[i], dd[i]}:
            if d >= 0:
                axes_on[d] = axes_on.get(d, 0) + 1
    cur = list(src)
    steps: list[Step] = []
    for i in range(n - 1, -1, -1):  # phase 1: unshard, inner axes first
        if not reset[i]:
            continue
        a, b = cur[i], dst[i]
        if a.__class__ is Shard:
            if b.__class__ is Shard and axes_on[sd[i]] == 1 and axes_on[dd[i]] == 1:
                steps.append(_step("all_to_all", i, sd[i], dd[i]))
                cur[i] = b
            else:
                steps.append(_step("all_gather", i, sd[i]))
                cur[i] = R
        elif isinstance(a, Partial):
            if b.__class__ is Shard and axes_on[dd[i]] == 1:
                steps.append(_step("reduce_scatter", i, dd[i]))
                cur[i] = b
            else:
                steps.append(_step("all_reduce", i))
                cur[i] = R
    for i in range(n):  # phase 2: shard, outer axes first
        want = dst[i]
        if reset[i] and cur[i] is not want:
            assert isinstance(cur[i], Replicate)
            steps.append(_step("shard", i, dd[i]) if want.__class__ is Shard else _step("to_partial", i))
            cur[i] = want
    return tuple(steps)


@lru_cache(maxsize=4096)
def _step(kind: str, axis: int, dim: int = -1, dim2: int = -1, grad_partial: bool = False) -> Step:
    """One ``Step`` object per distinct step (frozen, so shared): made once, not once per route planned."""
    return Step(kind, axis, dim, dim2, grad_partial)
