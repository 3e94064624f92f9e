"""The planning graph's types: variables (a strategy domain each), edges (a cost matrix each) and the graph."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from ..cost.pricing import PricingCache
from ..cost.profiles import Profile
from ..mesh import Mesh
from ..reshard import Route
from ..rules.base import OpSpec, Strategy


class VarKind(str, Enum):
    """What a variable stands for.  A ``str`` (members named as their values), so ``v.kind == "op"`` and string
    keys keep working; a misspelt kind is an error when the variable is made."""

    param = "param"
    buffer = "buffer"
    input = "input"
    op = "op"
    output = "output"
    reshard = "reshard"    # a value's shared use: its tiling and partial-gradient axes (``build``)

    def __str__(self) -> str:
        return self.value


@dataclass
class Var:
    name: str
    kind: VarKind | str           # a ``VarKind``; given as its name or value
    strategies: list[Strategy]
    compute_s: np.ndarray         # seconds per strategy (training step)
    memory: np.ndarray            # bytes per device per strategy
    fqn: str = ""
    op: OpSpec | None = None
    module: str = ""              # innermost nn.Module path, for reports and tying
    needs_grad: bool = False
    grad_partial: list[tuple[int, ...]] = field(default_factory=list)  # reshard points: per strategy, axes A
    pinned: bool = False          # stored tiling must be used as is (no resharding: model-parallel baseline)
    gathered: tuple[int, ...] = ()  # pinned, except on these axes: used whole there (FSDP: gather for use)
    # Per strategy, [bytes, seconds] of the communication inside the op (halo exchanges, summed statistics:
    # ``cost.collectives.op_comm_costs``), counted in ``compute_s`` for the search, reported as communication.
    op_comm: np.ndarray | None = None
    # A recomputed op: per strategy, the share of ``memory`` that is its unit's activations while the unit
    # reruns in backward (``_Rerun.memory``); None for any other variable.
    rerun_buffer: np.ndarray | None = None
    # A trainable parameter: per strategy, the share of ``memory`` that exists only after backward (its gradient,
    # the step's temporaries: ``cost.memory.grad_phase_bytes``); None for any other variable.
    grad_phase: np.ndarray | None = None
    # The op whose output is the largest: per strategy, the gradient bytes its backward holds at once at the
    # start of backward, while every activation is still kept (``backward_transient``), part of ``memory``.
    transient: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.kind = VarKind(self.kind)


@dataclass
class Edge:
    """One use of a value: output ``src_out`` of var ``src`` read as input ``dst_in`` of var ``dst``."""

    src: int
    dst: int
    src_out: int
    dst_in: int
    bytes: np.ndarray             # [len(src strategies), len(dst strategies)]
    seconds: np.ndarray
    shape: tuple[int, ...]
    itemsize: int
    needs_grad: bool
    # A parameter's own edge: its gradient all-reduce is deferred to the runtime's bucketed,
    # asynchronous gradient sync (``GradSync``), whose time ``sync`` gives (else None).
    deferred: bool
    sync: np.ndarray | None
    # A write-back: ``dst`` (an op) updates stored tensor ``src`` (a parameter or buffer) in place
    # through the copy it read in its own tiling, which travels back to the stored tiling.
    write_back: bool
    # The consumer's layer is recomputed: the read's forward collectives run again in backward (priced in).
    rerun: bool = False
    # The read ends in a returned sum that the generated program makes asynchronous (``returned_sum``): its
    # all-reduce runs, and is priced as, the backend's call (``edge_profile``).
    lazy: bool = False
    # Distinct (tiling, collected partial-gradient axes) of the source's strategies, and
    # (tiling, partial-gradient axes) of the consumer's, with each strategy's index into them.
    src_keys: list[tuple[tuple, tuple[int, ...]]] = field(default_factory=list)
    src_key_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    dst_keys: list[tuple[tuple, tuple[int, ...]]] = field(default_factory=list)
    dst_key_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def at(self, src: int, dst: int) -> Edge:
        """This edge between other vars (an equal read of a repeated layer): every other field the same objects,
        as ``dataclasses.replace`` gives, without its per-field checks (a table of 32 layers makes ~3,000)."""
        e = object.__new__(Edge)
        e.__dict__.update(self.__dict__)
        e.src, e.dst = src, dst
        return e

    def route(self, s: int, t: int) -> Route:
        """The route of this use when the source takes strategy ``s`` and the consumer ``t``."""
        (src, spa), (dst, pga) = self.src_keys[self.src_key_of[s]], self.dst_keys[self.dst_key_of[t]]
        return Route.of(dst, src) if self.write_back else Route.of(src, dst, pga, spa, self.needs_grad)


@dataclass
class PlanGraph:
    mesh: Mesh
    profile: Profile
    vars: list[Var] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    # Ops that make sizes depending on values, with those sizes as priced (``rules.datadep.data_dependent``).
    data_dependent: dict[str, dict[str, int]] = field(default_factory=dict)
    shapes: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # placeholder outputs
    dtypes: dict[tuple[int, int], torch.dtype] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)  # placeholders some op updates in place
    master_itemsize: int = 0  # bytes of a parameter's master copy under a mixed policy (0: as in the graph)
    # Bytes the rerun buffers' sum over-counts for sure (``rerun_credit``): the search bounds a plan's peak by
    # the sum of its variables' memory minus this constant; ``rerun_freed`` is what one plan's sum over-counts.
    rerun_credit: float = 0.0
    rerun_after: int = 0  # the first variable after the last recomputed op (its ops are freed when units rerun)
    # Microbatches whose activations are held at once (``PlanOptions.inflight``): each op's kept bytes count that
    # many times in its ``memory`` (``phases.hold_inflight``); a unit's rerun and the loss's backward, one.
    inflight: int = 1
    # Trainable parameters read at or after ``rerun_after``: their gradients exist when the last unit reruns.
    rerun_grads: list[int] = field(default_factory=list)
    # The planner run's pricing state (``cost.pricing``): the tables this graph was priced from, shared with the
    # run's other builds.
    pricing: PricingCache = field(default_factory=PricingCache, repr=False, compare=False)
    # False: the edges' tables are zeros, never priced (``build(..., priced=False)``): a lowering reads each edge's
    # route and flags only, and pricing them was most of each rank's build.
    priced: bool = True

    def __getstate__(self) -> dict:
        # Pickled without the run's pricing state (a planner worker sends its table: ``mesh_pool``); the receiver
        # gives it its own run's (``planner``), or it starts empty.
        return {k: v for k, v in self.__dict__.items() if k != "pricing"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.pricing = PricingCache()
