"""The collective kinds: one table that reshard planning, the cost model, lowering and the runtime read.

This module is vocabulary only: it imports neither the runtime nor codegen.  The call a generated program
makes for each kind is registered by the runtime (``runtime.kinds.CALLS``); codegen joins the two.

A reshard *step* changes one tensor's placement on one mesh axis.  Each kind of step is one
``Kind`` entry below, with everything any part of soybean knows about it:

=================  ==================  ====================  ====================================
kind               placement change    forward collective    backward (its adjoint)
=================  ==================  ====================  ====================================
all_gather         S(d) -> R           all_gather (after)    slice; reduce_scatter (after) when
                                                             ``grad_partial``
shard (slice)      R -> S(d)           --                    all_gather (before)
all_reduce         P -> R              all_reduce (before)   identity
reduce_scatter     P -> S(d)           reduce_scatter        all_gather (before)
                                       (before)
all_to_all         S(d) -> S(e)        all_to_all (before)   all_to_all back (before)
to_partial         R -> P              --                    identity
grad_all_reduce    R -> R              --                    all_reduce (before), the gradient
                                                             sync (Megatron's ``f``)
grad_to_partial    R -> R              --                    keep the gradient on member 0 only
halo               S(d) -> S(d)        point-to-point rows   the halo gradients sent back to
                   (its window)        of the neighbours     their owners and summed
=================  ==================  ====================  ====================================

"before"/"after" name the tiling whose local tile is the collective's message ``m`` (priced by
``cost.collectives``): the full result for all-gather, the full input for reduce-scatter, the
local buffer for all-reduce and all-to-all.  A ``halo`` step is not a reshard between two tilings
but a windowed op's read of its input (``rules.window``); ``cost.collectives.halo_cost`` prices it
by its rows, and the op's strategy carries that cost.  ``RING_FACTOR`` gives each collective's bytes sent
per device, ``f (p - 1) / p * m`` on a group of ``p``.  The runtime call is the ``sb_*``
function of ``runtime.context`` that a generated program makes (``runtime.kinds.CALLS``); its autograd
``Function`` (with the adjoint written next to it) is in ``runtime.collectives``.

Adding a kind: one entry here, its call in ``runtime.kinds.CALLS``, its ``Function`` and its dot-product
adjoint test.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..tiling import Partial, Placement, R, Shard

# Bytes sent per device by a ring collective of message m on p members: RING_FACTOR * (p - 1) / p * m.
RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


@dataclass(frozen=True)
class Step:
    """One reshard step on mesh ``axis``; ``kind`` names its entry in ``KINDS``."""

    kind: str
    axis: int
    dim: int = -1      # the dim gathered / sliced / scattered (all_to_all: source dim)
    dim2: int = -1     # all_to_all: destination dim
    grad_partial: bool = False  # all_gather only: backward is reduce_scatter
    full: int = 0               # halo only: length of ``dim``
    windows: tuple[tuple[int, int], ...] = ()  # halo only: every member's rows [s, e) of ``dim``
    fill: float = 0.0           # halo only: the value of rows outside [0, full)
    # Steps key the walk's cache (``reshard``), hashed once per step met: computed once.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.kind, self.axis, self.dim, self.dim2, self.grad_partial,
                                                self.full, self.windows, self.fill)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # Rebuilt, not copied: the cached hash is this process's (string hashing is salted per process).
        return (Step, (self.kind, self.axis, self.dim, self.dim2, self.grad_partial, self.full, self.windows,
                       self.fill))

    def __str__(self) -> str:
        extra = KINDS[self.kind].describe(self)
        return f"{self.kind}[axis {self.axis}{' ' + extra if extra else ''}]"


@dataclass(frozen=True)
class Priced:
    """A collective that a step runs: its name (a ``RING_FACTOR`` key) and which tiling's local tile
    is its message: the tensor's tiling ``before`` or ``after`` the step."""

    collective: str
    message: str


@dataclass(frozen=True)
class Kind:
    """Everything soybean knows about one kind of reshard step."""

    name: str
    placement: Callable[[Placement, Step], Placement]    # the axis's placement after the step
    forward: Priced | None                               # collective run in forward (None: local)
    backward: Priced | None                              # its adjoint's collective (None: local)
    # The generated program calls ``runtime.kinds.CALLS[name](x, axis, *args)``, with these ``args`` from the
    # step and the local shape after it.
    args: Callable[[Step, tuple[int, ...]], tuple]
    describe: Callable[[Step], str] = lambda s: ""       # the step's detail in reports
    backward_partial: Priced | None = None               # the adjoint when ``grad_partial`` (all_gather)
    # The backward all-reduce is the gradient sync of a replicated value used by split work: on a
    # parameter's own edge the runtime defers it to the bucketed, asynchronous ``GradSync``.
    gradient_sync: bool = False
    viewable: bool = False                               # may return a view of a read-only input

    def adjoint(self, step: Step) -> Priced | None:
        """The collective the step's backward runs."""
        return self.backward_partial if step.grad_partial else self.backward


def _dim(s: Step) -> str:
    return f"dim {s.dim}"


def _same(p: Placement, s: Step) -> Placement:
    return p


_KINDS = (
    Kind("all_gather", lambda p, s: R, Priced("all_gather", "after"), None,
         lambda s, after: (s.dim, after[s.dim], s.grad_partial), _dim,
         backward_partial=Priced("reduce_scatter", "after")),
    Kind("shard", lambda p, s: Shard(s.dim), None, Priced("all_gather", "before"),
         lambda s, after: (s.dim,), _dim, viewable=True),
    Kind("all_reduce", lambda p, s: R, Priced("all_reduce", "before"), None, lambda s, after: ()),
    Kind("reduce_scatter", lambda p, s: Shard(s.dim), Priced("reduce_scatter", "before"),
         Priced("all_gather", "before"), lambda s, after: (s.dim,), _dim),
    # The adjoint all-to-all's message is the gradient's local buffer, tiled like the step's result.
    Kind("all_to_all", lambda p, s: Shard(s.dim2), Priced("all_to_all", "before"), Priced("all_to_all", "after"),
         lambda s, after: (s.dim, s.dim2, after[s.dim]), lambda s: f"S({s.dim})->S({s.dim2})"),
    Kind("to_partial", lambda p, s: Partial(), None, None, lambda s, after: ()),
    Kind("grad_all_reduce", _same, None, Priced("all_reduce", "before"), lambda s, after: (),
         gradient_sync=True),
    Kind("grad_to_partial", _same, None, None, lambda s, after: ()),
    Kind("halo", _same, Priced("halo", "before"), Priced("halo", "before"),
         lambda s, after: (s.dim, s.full, s.windows, s.fill), _dim),
)
KINDS: dict[str, Kind] = {k.name: k for k in _KINDS}


def apply_step(tiling: tuple[Placement, ...], step: Step) -> tuple[Placement, ...]:
    """The tiling after ``step``."""
    t = list(tiling)
    t[step.axis] = KINDS[step.kind].placement(t[step.axis], step)
    return tuple(t)


__all__ = ["KINDS", "Kind", "Priced", "RING_FACTOR", "Step", "apply_step"]
