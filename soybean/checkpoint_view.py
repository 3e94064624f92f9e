"""A checkpoint of a model run in parts on their own ranks (pipeline stages, placed regions) as one module.

``runtime.checkpoint`` saves and loads one ``Tiled`` module: tensors by the model's names, each on a device mesh.
A pipelined or placed plan holds its tensors in several ``ParallelModule``s, each on its own ranks' submesh;
``CheckpointView`` presents them as that one module, so a checkpoint written under any plan (with parts or
without) loads under any other (DCP reshards), AdamW's moments included.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .capture import Captured
from .module import ParallelModule
from .plan import Plan
from .runtime.checkpoint_dir import CheckpointError


class Parts(Protocol):
    """What ``CheckpointView`` reads of a module run in parts: every part's capture, ranks and plan (in order,
    the same on every rank), the whole plan, this rank's parts with their indices, and the weights several parts
    read (``_ties``: each one's name, this rank's reading modules and the group summing over their holders;
    ``_groups``: how many rank groups hold parts)."""

    plan: Plan
    _stage_caps: list[Captured]
    _stage_ranks: list[list[int]]
    _plans: list[Plan]
    _ties: list[tuple[str, list[ParallelModule], Any]]
    _groups: int

    def local_parts(self) -> list[tuple[int, ParallelModule]]: ...


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
    weight several parts read is saved by the first of them (the others' copies are equal) and its copies on this
    rank are refreshed after a load (``copy_ties``).  The catalog is every part's tensors, so a checkpoint names
    the whole model on every rank."""

    def __init__(self, pipe: Parts) -> None:
        super().__init__()
        from .module import _attach
        from .runtime.checkpoint import submesh

        self._pipe: Parts
        object.__setattr__(self, "_pipe", pipe)  # not a submodule: the view's parameters are the stages' by name
        first: dict[str, int] = {}  # each tensor's first stage
        for k, cap in enumerate(pipe._stage_caps):
            for fqn in [*cap.params.values(), *cap.buffers.values()]:
                first.setdefault(fqn, k)
        self._meshes = [submesh(r, p.mesh) for r, p in zip(pipe._stage_ranks, pipe._plans)]  # every rank, in order
        self._first = first
        self._owner: dict[str, tuple[ParallelModule, int]] = {}
        self._copies: dict[str, list[ParallelModule]] = {}
        for i, pm in pipe.local_parts():
            for kind, fqn in pm._state():
                if first[fqn] == i:
                    self._owner[fqn] = (pm, i)
                    _attach(self, fqn, pm._tensor(kind, fqn), kind, shared=True)
                else:
                    self._copies.setdefault(fqn, []).append(pm)
        self.plan = ViewPlan(pipe.plan.devices, list(pipe.plan.mesh), pipe.plan.fingerprint,
                              {f: pm.plan.param_tiling(f) for f, (pm, _) in self._owner.items()})
        self._all: dict[str, dict[str, Any]] = {}
        for cap in pipe._stage_caps:
            for node in cap.graph.nodes:
                name = cap.params.get(node.name) or cap.buffers.get(node.name)
                if node.op == "placeholder" and name is not None and name not in cap.constants:
                    v = node.meta["val"]
                    self._all.setdefault(name, {"shape": list(v.shape), "dtype": str(v.dtype)})

    def _state(self) -> Iterator[tuple[str, str]]:
        for fqn, (pm, _) in self._owner.items():
            yield next((k, f) for k, f in pm._state() if f == fqn)

    def _tensor(self, kind: str, fqn: str) -> torch.Tensor:
        return self._owner[fqn][0]._tensor(kind, fqn)

    def _full_shape(self, fqn: str) -> tuple[int, ...]:
        return self._owner[fqn][0]._full_shape(fqn)

    def _mesh_of(self, fqn: str) -> Any:
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
        """``optimizer`` without this rank's copies of tied weights (their parameters and state) while the block
        runs: a checkpoint holds each weight's optimizer state once, by name (the copies' state is the owner's: the
        same gradients, the same steps)."""
        copies = [pm.get_parameter(f) for f, pms in self._copies.items() for pm in pms]
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

    def _whole(self, fqn: str, group: Any, owner_tile: torch.Tensor | None, like: ParallelModule,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor of which the owner of ``fqn`` holds ``owner_tile`` (its tiling's), on every rank of the
        tie: gathered within the owner's stage, summed with zeros over the tie's group."""
        whole: torch.Tensor | None = None
        own = self._owner.get(fqn)
        if own is not None:
            assert owner_tile is not None
            whole = own[0].whole(fqn, owner_tile)
        if group is not None:
            buf = whole if whole is not None else torch.zeros(like._full_shape(fqn),
                                                              dtype=dtype or like.get_parameter(fqn).dtype)
            dist.all_reduce(buf, group=group)
            whole = buf
        assert whole is not None
        return whole

    @torch.no_grad()
    def copy_ties(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A tied weight's copies take the value (and, with ``optimizer``, the optimizer state) of its first
        reader's: gathered whole, shared over the tie's group, each copy its tile."""
        pipe = self._pipe
        per = dist.get_world_size() // pipe._groups
        for fqn, mods, group in pipe._ties:
            own = self._owner.get(fqn)
            owner_param = own[0].get_parameter(fqn) if own is not None else None
            whole = self._whole(fqn, group, owner_param.detach() if owner_param is not None else None, mods[0])
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
                src = (self._first[fqn] % pipe._groups) * per + dist.get_rank() % per
                dist.broadcast_object_list(kinds, src=src, group=group)
            for k, kind in sorted(kinds[0].items()):
                if isinstance(kind, tuple) and kind and kind[0] == "tile":
                    full = self._whole(fqn, group, state[k] if owner_param is not None else None, mods[0], kind[1])
                    for pm in copies:
                        optimizer.state[pm.get_parameter(fqn)][k] = pm.tile(fqn, full)
                else:
                    for pm in copies:
                        optimizer.state[pm.get_parameter(fqn)][k] = kind.clone() if isinstance(
                            kind, torch.Tensor) else kind
