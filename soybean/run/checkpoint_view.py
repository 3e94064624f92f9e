"""The state of a model run in parts on their own ranks (pipeline stages, placed regions), as one module has it.

A pipelined or placed plan holds its tensors in several ``ParallelModule``s, each on its own ranks' submesh.
``PartsModule``, the base of ``pipelined.PipelinedModule`` and ``placed.PlacedModule``, gives them the state API
of a ``ParallelModule`` (``full_tensors``, ``full_state_dict``, ``load_full_state_dict``, ``save_sharded``,
``load_sharded``) in one place: the model's own names, each tensor once (a weight several parts read is a copy in
each; the first part's is the one saved and returned), and the tensors no part reads (a layer forward never
calls: in no part's capture) kept whole beside the parts, so the state is the serial model's whole state.

``runtime.checkpoint`` saves and loads one ``Tiled`` module: tensors by the model's names, each on a device mesh.
``CheckpointView`` presents the parts as that one module, so a checkpoint written under any plan (with parts or
without) loads under any other (DCP reshards), AdamW's moments included.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..capture.core import Captured
from ..plan import Plan
from ..runtime.checkpoint_dir import CheckpointError
from ..tiling import R
from . import grad_norm as norms
from .module import ParallelModule, split_weights


@dataclass
class Tie:
    """A trained weight several parts read (``part.shared_params``), as one rank takes part in summing its copies'
    gradients: this rank's reading parts (their indices and modules, ascending), whether this rank adds each one's
    whole gradient to the sum (each part's gradient must be counted once over ``group``), the group the sums are
    all-reduced over (None: every reader is on this rank), and ``src``, the rank of that group holding the first
    reader's copy (the one a checkpoint keeps, ``CheckpointView``) that shares its optimizer state's layout."""

    fqn: str
    parts: list[int]
    modules: list[ParallelModule]
    counted: list[bool]
    group: Any
    src: int


def _first_reader(first: dict[str, int], part: int, fqn: str) -> bool:
    """Whether ``part`` is the first part that reads ``fqn`` (``first``: each weight's first reader)."""
    return first.get(fqn, part) == part


class PartsModule(nn.Module):
    """A model run in parts on their own ranks (module docstring): the base of ``PipelinedModule`` (its stages) and
    ``PlacedModule`` (its regions).  A subclass calls ``_hold_parts`` with every part's capture, ranks and plan (in
    order, the same on every rank) and defines ``local_parts``; ``_ties`` are the trained weights several parts
    read that this rank holds a copy of (``Tie``), whose gradients ``_sum_tied_grads`` sums once per step."""

    plan: Plan
    _stage_caps: list[Captured]
    _stage_ranks: list[list[int]]
    _plans: list[Plan]
    _ties: list[Tie]
    _unread: dict[str, torch.Tensor]
    _checkpoint_view: CheckpointView | None

    def _hold_parts(self, model: nn.Module, caps: Sequence[Captured], ranks: Sequence[Sequence[int]],
                    plans: Sequence[Plan]) -> None:
        """Record the parts (``caps``, ``ranks``, ``plans``) and keep a copy of the tensors of ``model`` that no
        part reads (by every name, aliases included: one copy per tensor), which training cannot change."""
        self._stage_caps = list(caps)
        self._stage_ranks = [list(r) for r in ranks]
        self._plans = list(plans)
        self._checkpoint_view = None
        named = list(itertools.chain(model.named_parameters(remove_duplicate=False),
                                     model.named_buffers(remove_duplicate=False)))
        read = {n for c in caps for n in itertools.chain(c.params.values(), c.buffers.values())}
        read_ids = {id(t) for n, t in named if n in read}  # a tied alias is read when its tensor is
        copies: dict[int, torch.Tensor] = {}
        self._unread = {n: copies.setdefault(id(t), t.detach().clone()) for n, t in named if id(t) not in read_ids}

    def local_parts(self) -> list[tuple[int, ParallelModule]]:
        """This rank's parts with their indices, ascending."""
        raise NotImplementedError

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        """Each copy of a weight several parts read gets the sum of their gradients (the serial one), after the
        step's backward: every reader's gradient gathered whole within its part's ranks (``ParallelModule.whole``),
        the ones this rank counts summed, then summed over the tie's group (``dist.all_reduce``), and each copy takes
        its tile of the sum (``ParallelModule.tile``).  Every rank walks the ties in one order, each tie's parts
        ascending, so every group's collectives meet."""
        for tie in self._ties:
            total: torch.Tensor | None = None
            for pm, counted in zip(tie.modules, tie.counted):
                p = pm.get_parameter(tie.fqn)
                whole = pm.whole(tie.fqn, p.grad if p.grad is not None else torch.zeros_like(p))
                if counted:
                    total = whole if total is None else total + whole
                elif total is None:
                    total = torch.zeros_like(whole)
            assert total is not None
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for pm in tie.modules:
                p = pm.get_parameter(tie.fqn)
                p.grad = pm.tile(tie.fqn, total).to(p.dtype)

    def split_weights(self) -> list[str]:
        """The trained weights some part's plan stores split (``soybean.run.optimizers``)."""
        return split_weights(list(zip(self._stage_caps, self._plans)))

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The serial model's gradient norm (``soybean.run.grad_norm``), the same on every rank (every rank calls
        it): each part's share over its own ranks (``ParallelModule.grad_share``), a weight several parts read
        counted in the first that reads it (its copies hold the same summed gradient), summed over the world."""
        q = norms.check_norm_type(norm_type)
        first: dict[str, int] = {}
        for k, cap in enumerate(self._stage_caps):
            for fqn in cap.params.values():
                first.setdefault(fqn, k)
        total: torch.Tensor | None = None
        dtype = torch.float32
        for k, pm in self.local_parts():
            mine = pm.grad_share(q, counted=functools.partial(_first_reader, first, k))
            total = mine if total is None else torch.maximum(total, mine) if math.isinf(q) else total + mine
            dtype = next((p.grad.dtype for p in pm.parameters() if p.grad is not None), dtype)
        if total is None:
            total = torch.zeros((), dtype=torch.float64)
        return norms.norm_of(norms.world_total(total, q), q, dtype)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """``ParallelModule.clip_grad_norm_`` over every part: each gradient tile this rank holds scaled by the one
        factor of the serial norm; returns it.  After ``train_step``, on every rank."""
        total = self.grad_norm(norm_type)
        norms.clip((p for _, pm in self.local_parts() for p in pm.parameters()), max_norm, total, error_if_nonfinite)
        return total

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter and buffer (non-persistent ones included) by the model's own names,
        tied aliases included, on every rank (on the CPU): each part's gathered within its ranks
        (``ParallelModule.full_tensors``) and sent from its first rank to every rank, a tensor several parts read
        once (the first's); the tensors no part reads beside them."""
        out: dict[str, torch.Tensor] = {}
        local = dict(self.local_parts())
        for k, ranks in enumerate(self._stage_ranks):
            box: list[Any] = [None]
            if k in local:
                full = local[k].full_tensors()
                if dist.get_rank() == ranks[0]:
                    box = [{n: t.cpu() for n, t in full.items() if n not in out}]
            dist.broadcast_object_list(box, src=ranks[0])
            out.update(box[0])
        out.update({n: t.cpu().clone() for n, t in self._unread.items()})
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``model.state_dict()`` of the serial model gives for the current values, on every rank:
        ``full_tensors`` named and laid out by the model's own state-dict hooks (``ParallelModule.full_state_dict``;
        its skeleton)."""
        tensors = self.full_tensors()
        pm = self.local_parts()[0][1]
        if pm._skeleton is None:
            return tensors
        with pm._filled_skeleton(tensors) as sk:
            return {k: v.detach() for k, v in sk.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load what the serial model's ``state_dict()`` gives: each part takes its own tensors (its tiles, every
        copy of a tensor several parts read alike), the tensors no part reads theirs."""
        parts = self.local_parts()
        for _, pm in parts:
            pm.load_full_state_dict(sd)
        if not self._unread:
            return
        missing, full = parts[0][1].by_own_names(sd)
        for name, t in self._unread.items():
            if name in full:
                t.copy_(full[name])
            elif name in missing:
                raise KeyError(f"state dict has no {name}")

    def _view(self) -> CheckpointView:
        if self._checkpoint_view is None:
            self._checkpoint_view = CheckpointView(self)
        return self._checkpoint_view

    def save_sharded(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
                     extra: Any = None, keep: int | None = None) -> Path:
        """``ParallelModule.save_sharded`` across parts: every rank writes its parts' tiles (a tensor several parts
        read by the first of them) as DTensors on their part's submesh, so the checkpoint loads under any plan, in
        parts or not (DCP reshards)."""
        from ..runtime.checkpoint import save

        view = self._view()
        with view.hiding_copies(optimizer):
            return save(view, path, optimizer, extra, keep)

    def load_sharded(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Any:
        """``ParallelModule.load_sharded`` across parts: each part reads its own tiles from a checkpoint saved
        under any plan; a tensor's other copies take the first's (``CheckpointView.copy_ties``)."""
        from ..runtime.checkpoint import load

        view = self._view()
        with view.hiding_copies(optimizer):
            extra = load(view, path, optimizer)
        view.copy_ties(optimizer)
        return extra


@dataclass
class ViewPlan:
    """What a checkpoint reads of a plan, for tensors on several stages' submeshes."""

    devices: int
    mesh: list[int]
    fingerprint: str | None
    tilings: dict[str, Any]

    def param_tiling(self, fqn: str) -> Any:
        return self.tilings[fqn]


class CheckpointView(nn.Module):
    """This rank's parts (a pipeline's stages, a placed plan's regions) as the one module ``runtime.checkpoint``
    saves and loads (its ``Tiled``): each tensor by the model's name, once, on its part's submesh (``_mesh_of``); a
    tensor several parts read is saved by the first of them (the others' copies are equal) and its copies on this
    rank are refreshed after a load (``copy_ties``); the tensors no part reads (``PartsModule._unread``) whole on
    every rank.  The catalog is every part's tensors and those, so a checkpoint names the whole model on every
    rank."""

    def __init__(self, pipe: PartsModule) -> None:
        super().__init__()
        from ..runtime.checkpoint import submesh
        from .module import _attach

        self._pipe: PartsModule
        object.__setattr__(self, "_pipe", pipe)  # not a submodule: the view's parameters are the stages' by name
        first: dict[str, int] = {}  # each tensor's first stage
        readers: dict[str, int] = {}
        trained: set[str] = set()
        for k, cap in enumerate(pipe._stage_caps):
            for fqn in dict.fromkeys([*cap.params.values(), *cap.buffers.values()]):
                first.setdefault(fqn, k)
                readers[fqn] = readers.get(fqn, 0) + 1
            trained.update(f for f in cap.params.values() if f not in cap.frozen)
        # read by several parts, but not trained: a buffer or frozen weight (a trained one is a tie: ``_ties``)
        self._untied = [f for f, n in readers.items() if n > 1 and f not in trained]
        self._params = {f for cap in pipe._stage_caps for f in cap.params.values()}
        self._meshes = [submesh(r, p.mesh) for r, p in zip(pipe._stage_ranks, pipe._plans)]  # every rank, in order
        self._first = first
        self._owner: dict[str, tuple[ParallelModule, int]] = {}
        self._copies: dict[str, list[ParallelModule]] = {}
        self._kind: dict[str, str] = {}
        for i, pm in pipe.local_parts():
            for kind, fqn in pm._state():
                self._kind[fqn] = kind
                if first[fqn] == i:
                    self._owner[fqn] = (pm, i)
                    _attach(self, fqn, pm._tensor(kind, fqn), kind, shared=True)
                else:
                    self._copies.setdefault(fqn, []).append(pm)
        # the tensors no part reads: each once (not its aliases), whole on every rank's mesh
        self._unread: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for fqn, t in pipe._unread.items():
            if id(t) not in seen:
                seen.add(id(t))
                self._unread[fqn] = t
        self._world_mesh = submesh(range(dist.get_world_size()), [dist.get_world_size()]) if self._unread else None
        self.plan = ViewPlan(pipe.plan.devices, list(pipe.plan.mesh), pipe.plan.fingerprint,
                              {**{f: pm.plan.param_tiling(f) for f, (pm, _) in self._owner.items()},
                               **{f: (R,) for f in self._unread}})
        self._all: dict[str, dict[str, Any]] = {}
        for cap in pipe._stage_caps:
            for node in cap.graph.nodes:
                name = cap.params.get(node.name) or cap.buffers.get(node.name)
                if node.op == "placeholder" and name is not None and name not in cap.constants:
                    v = node.meta["val"]
                    self._all.setdefault(name, {"shape": list(v.shape), "dtype": str(v.dtype)})
        for fqn, t in self._unread.items():
            self._all[fqn] = {"shape": list(t.shape), "dtype": str(t.dtype)}

    def _state(self) -> Iterator[tuple[str, str]]:
        for fqn in self._owner:
            yield self._kind[fqn], fqn
        for fqn in self._unread:
            yield "buffer", fqn  # whole, outside every part: no optimizer state to find it by

    def _tensor(self, kind: str, fqn: str) -> torch.Tensor:
        if fqn in self._unread:
            return self._unread[fqn]
        return self._owner[fqn][0]._tensor(kind, fqn)

    def _full_shape(self, fqn: str) -> tuple[int, ...]:
        if fqn in self._unread:
            return tuple(self._unread[fqn].shape)
        return self._owner[fqn][0]._full_shape(fqn)

    def _mesh_of(self, fqn: str) -> Any:
        if fqn in self._unread:
            return self._world_mesh
        return self._meshes[self._owner[fqn][1]]

    def _merged_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The optimizer's parameter groups with every rank's parameter names (each rank holds only its stages'):
        a checkpoint stores the groups once for all ranks, and each rank finds its own parameters' group in
        them."""
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, [list(g["params"]) for g in groups])
        if len({len(e) for e in every}) > 1:
            raise CheckpointError("the ranks' optimizers have different numbers of parameter groups: build one "
                                  "optimizer over pmodel.parameters() on every rank, its groups alike")
        return [{**g, "params": list(dict.fromkeys(n for e in every for n in e[i]))} for i, g in enumerate(groups)]

    def _catalog(self) -> dict[str, dict[str, Any]]:
        return dict(self._all)

    @contextlib.contextmanager
    def hiding_copies(self, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        """``optimizer`` without this rank's copies of weights several parts read (their parameters and state)
        while the block runs: a checkpoint holds each weight's optimizer state once, by name (the copies' state is
        the owner's: the same gradients, the same steps)."""
        copies = [pm.get_parameter(f) for f, pms in self._copies.items() if f in self._params for pm in pms]
        if optimizer is None or not copies:
            yield
            return
        hidden = {id(p) for p in copies}
        groups = [list(g["params"]) for g in optimizer.param_groups]
        states: dict[torch.Tensor, Any] = {p: optimizer.state.pop(p) for p in copies if p in optimizer.state}
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) not in hidden]
        try:
            yield
        finally:
            for g, params in zip(optimizer.param_groups, groups):
                g["params"] = params
            optimizer.state.update(states)

    def _whole(self, tie: Tie, owner_tile: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor of which the owner of ``tie``'s weight holds ``owner_tile`` (its tiling's), on every rank
        of the tie: gathered within the owner's part, summed with zeros over the tie's group (counted once: by the
        ranks ``tie.counted`` names)."""
        fqn, like = tie.fqn, tie.modules[0]
        whole: torch.Tensor | None = None
        own = self._owner.get(fqn)
        if own is not None:
            assert owner_tile is not None
            whole = own[0].whole(fqn, owner_tile)
            if tie.group is not None and not tie.counted[tie.parts.index(own[1])]:
                whole = torch.zeros_like(whole)
        if tie.group is not None:
            buf = whole if whole is not None else torch.zeros(like._full_shape(fqn),
                                                              dtype=dtype or like.get_parameter(fqn).dtype)
            dist.all_reduce(buf, group=tie.group)
            whole = buf
        assert whole is not None
        return whole

    @torch.no_grad()
    def copy_ties(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A tied weight's copies take the value (and, with ``optimizer``, the optimizer state) of its first
        reader's: gathered whole, shared over the tie's group, each copy its tile.  Then the copies of the other
        tensors several parts read (``_untied``: buffers, frozen weights) take their first reader's value."""
        self._copy_ties(optimizer)
        pipe = self._pipe
        for fqn in self._untied:  # every rank, in the same order
            src = pipe._stage_ranks[self._first[fqn]][0]
            box: list[Any] = [None]
            own = self._owner.get(fqn)
            if own is not None:  # every rank of the first reader's part: its tile gathered whole
                whole = own[0].whole(fqn, own[0]._tensor(self._kind[fqn], fqn).detach())
                if dist.get_rank() == src:
                    box = [whole.cpu()]
            dist.broadcast_object_list(box, src=src)
            for pm in self._copies.get(fqn, []):
                pm._tensor(self._kind[fqn], fqn).copy_(pm.tile(fqn, box[0]))

    def _copy_ties(self, optimizer: torch.optim.Optimizer | None) -> None:
        """``copy_ties`` of the tied trained weights (``PartsModule._ties``), optimizer state included."""
        for tie in self._pipe._ties:
            fqn, group = tie.fqn, tie.group
            own = self._owner.get(fqn)
            owner_param = own[0].get_parameter(fqn) if own is not None else None
            whole = self._whole(tie, owner_param.detach() if owner_param is not None else None)
            copies = self._copies.get(fqn, [])
            for pm in copies:
                pm.get_parameter(fqn).copy_(pm.tile(fqn, whole))
            if optimizer is None:
                continue
            # the owner's state: per-element tensors (its tile's shape) shared as wholes, the rest as they are
            state = optimizer.state.get(owner_param, {}) if owner_param is not None else {}
            kinds: list[Any] = [{k: (("tile", v.dtype) if isinstance(v, torch.Tensor) and owner_param is not None
                                     and v.shape == owner_param.shape and v.dim() else v)
                                 for k, v in state.items()}]
            if group is not None:
                dist.broadcast_object_list(kinds, src=tie.src, group=group)
            for k, kind in sorted(kinds[0].items()):
                if isinstance(kind, tuple) and kind and kind[0] == "tile":
                    full = self._whole(tie, state[k] if owner_param is not None else None, kind[1])
                    for pm in copies:
                        optimizer.state[pm.get_parameter(fqn)][k] = pm.tile(fqn, full)
                else:
                    for pm in copies:
                        optimizer.state[pm.get_parameter(fqn)][k] = kind.clone() if isinstance(
                            kind, torch.Tensor) else kind
