"""Sharded checkpoints of a model's tiles and its optimizer's state, with ``torch.distributed.checkpoint`` (DCP).

Each rank's tiles are wrapped as ``DTensor``s on a ``DeviceMesh`` of the plan's shape (soybean's chunking is
DTensor's, so ``from_local`` needs no copy), so a checkpoint written under one plan loads under any other plan,
world size or mesh: DCP reshards.  The optimizer's state is taken with DCP's ``get_optimizer_state_dict`` (keyed
by parameter name, so it is independent of the optimizer's parameter order) and every per-element state
(AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum: a tensor of its parameter's tile shape) is wrapped with
its parameter's tiling, so the moments reshard exactly as the weights do; scalars (AdamW's ``step``) and the
hyper-parameters are the same on every rank and saved once.

A save is collective: every rank writes its own shards into a partial directory, then rank 0 writes ``extra``
and the manifest and commits by rename (:mod:`.checkpoint_dir`), so a crash mid-save leaves the previous
checkpoint loadable.  With one device and no process group (``devices=1`` in one process) the tensors are whole
and DCP runs without a group; such a checkpoint loads under any plan too.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..tiling import R, to_torch
from . import checkpoint_dir as store
from .checkpoint_dir import CheckpointError

__all__ = ["save", "load", "CheckpointError", "KeptMesh", "device_mesh", "sharded_state_dict", "submesh"]


class TiledPlan(Protocol):
    """What a checkpoint reads of a plan."""

    @property
    def devices(self) -> int: ...

    @property
    def mesh(self) -> Sequence[int]: ...

    @property
    def fingerprint(self) -> str | None: ...

    def param_tiling(self, fqn: str) -> Any: ...


class Tiled(Protocol):
    """What a checkpoint reads of a ``ParallelModule``: a protocol, so that the runtime never imports
    ``soybean.run.module`` (which imports the runtime)."""

    @property
    def plan(self) -> TiledPlan: ...

    def _state(self) -> Iterator[tuple[str, str]]: ...  # (kind, fqn) of every parameter and buffer

    def _tensor(self, kind: str, fqn: str) -> torch.Tensor: ...

    def _full_shape(self, fqn: str) -> tuple[int, ...]: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def _mesh_of(self, fqn: str) -> DeviceMesh: ...  # the mesh tensor ``fqn``'s tiles lie on, kept by the module


def _distributed(pm: Tiled) -> bool:
    """Whether tiles are DTensors over a process group (False: one device, no group, whole tensors)."""
    if dist.is_initialized():
        return True
    if pm.plan.devices == 1:
        return False
    raise RuntimeError("sharded checkpoints of more than one device need torch.distributed: run under torchrun, "
                       "`soybean run` or spawn (ranks simulated as threads cannot checkpoint)")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_mesh(shape: Sequence[int]) -> DeviceMesh:
    """A new DeviceMesh of ``shape`` over the whole world (a ``ParallelModule``'s plan's mesh).  Making one creates
    its process groups, a collective: every rank makes it, and the caller keeps it (a module, for all its
    checkpoints)."""
    return init_device_mesh(_device(), tuple(shape))


class KeptMesh:
    """The DeviceMesh a module's tiles lie on in its checkpoints, kept by that module for all of them (its
    ``_mesh_of``): made at its first save or load (making one creates process groups, a collective every rank runs
    alike), made anew for another shape or under a new world process group."""

    def __init__(self) -> None:
        self._made: tuple[int, tuple[int, ...], DeviceMesh] | None = None

    def of(self, shape: Sequence[int]) -> DeviceMesh:
        """The kept mesh of ``shape`` over the whole world."""
        world, dims = id(dist.group.WORLD), tuple(shape)
        if self._made is None or self._made[:2] != (world, dims):
            self._made = (world, dims, device_mesh(dims))
        return self._made[2]


def submesh(ranks: Sequence[int], shape: Sequence[int]) -> DeviceMesh:
    """A new DeviceMesh of ``shape`` over ``ranks`` (a pipeline stage's devices); every rank must make every one,
    in the same order (making one creates its groups), and the caller keeps them (``CheckpointView``)."""
    return DeviceMesh(_device(), torch.tensor(list(ranks)).reshape(tuple(shape)))


def _wrap(t: torch.Tensor, pm: Tiled, fqn: str, distributed: bool) -> torch.Tensor:
    """The tile ``t`` of tensor ``fqn`` as a DTensor of its full shape on the mesh the module keeps for it
    (``_mesh_of``; a pipelined module's tensors lie on several submeshes); as it is without a process group."""
    if not distributed:
        return t
    mesh = pm._mesh_of(fqn)
    shape = pm._full_shape(fqn)
    return DTensor.from_local(t, mesh, [to_torch(p) for p in pm.plan.param_tiling(fqn)], run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def sharded_state_dict(pm: Tiled) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ParallelModule ``pm`` as a DTensor viewing the local tile."""
    distributed = _distributed(pm)
    return {fqn: _wrap(pm._tensor(kind, fqn).detach(), pm, fqn, distributed) for kind, fqn in pm._state()}


def _catalog(pm: Tiled) -> dict[str, dict[str, Any]]:
    """Every tensor of the model (name: full shape and dtype), what a checkpoint of it holds: ``pm``'s own, or
    every stage's for a module that holds only some of them (``_catalog``)."""
    if (of := getattr(pm, "_catalog", None)) is not None:
        return of()
    return {fqn: {"shape": list(pm._full_shape(fqn)), "dtype": str(pm._tensor(kind, fqn).dtype)}
            for kind, fqn in pm._state()}


def _optimizer_state(pm: Tiled, optimizer: torch.optim.Optimizer, distributed: bool) -> dict[str, Any]:
    """DCP's state dict of ``optimizer`` (initialised by one zero-gradient step at learning rate 0 when empty,
    so a load has every state to fill) with its per-element states wrapped."""
    osd: dict[str, Any] = dict(get_optimizer_state_dict(pm, optimizer))  # type: ignore[arg-type]
    if (merge := getattr(pm, "_merged_groups", None)) is not None:
        osd["param_groups"] = merge(osd["param_groups"])
    params = dict(pm.named_parameters())
    # New dicts: the optimizer's state_dict() hands out its own per-parameter dicts, which must keep plain tensors.
    osd["state"] = {fqn: dict(states) for fqn, states in osd["state"].items()}
    for fqn, states in osd["state"].items():
        tile = params[fqn]
        whole = all(p == R for p in pm.plan.param_tiling(fqn))
        for k, v in list(states.items()):
            if not isinstance(v, torch.Tensor) or (v.dim() == 0 and tile.dim() > 0):
                continue  # a hyper-parameter or a scalar (AdamW's step): the same on every rank
            if tuple(v.shape) != tuple(tile.shape):
                if whole:
                    continue  # a replicated parameter's state is the same on every rank, whatever its shape
                raise CheckpointError(f"optimizer state {k!r} of {fqn} has shape {list(v.shape)}, not its tile's "
                                      f"{list(tile.shape)}: soybean checkpoints per-element optimizer state (Adam, "
                                      "AdamW, SGD with momentum) of split parameters; keep this parameter whole")
            states[k] = _wrap(v, pm, fqn, distributed)
    return osd


def _manifest(pm: Tiled, optimizer: torch.optim.Optimizer | None, extra: bool) -> dict[str, Any]:
    return {"tensors": _catalog(pm),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "extra": extra, "devices": pm.plan.devices, "mesh": list(pm.plan.mesh),
            "fingerprint": pm.plan.fingerprint}


@contextmanager
def _quiet(distributed: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what we asked for."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank0(distributed: bool) -> bool:
    return not distributed or dist.get_rank() == 0


def save(pm: Tiled, root: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None, keep: int | None = None) -> Path:
    """Write ``pm``'s tiles (and ``optimizer``'s state, and the picklable ``extra``) as a new checkpoint under
    ``root``; every rank calls it.  Returns the committed checkpoint's directory.  ``keep``: how many
    committed checkpoints to leave (the newest), None for all."""
    distributed = _distributed(pm)
    base = Path(root)
    box: list[Any] = [None]
    if _rank0(distributed):
        try:
            if store.is_checkpoint(base):
                raise CheckpointError(f"{base} is one checkpoint, not a directory of them: save to its parent")
            base.mkdir(parents=True, exist_ok=True)
            box[0] = store.next_index(base)
            (base / store.partial_name(box[0])).mkdir()
        except Exception as e:  # every rank raises it, rather than the others waiting for a save that never comes
            box[0] = e
    if distributed:
        dist.broadcast_object_list(box, src=0)  # also: nobody writes before rank 0 made the directory
    if isinstance(box[0], Exception):
        raise box[0]
    partial = base / store.partial_name(box[0])
    state: dict[str, Any] = {"model": sharded_state_dict(pm)}
    if optimizer is not None:
        state["optim"] = _optimizer_state(pm, optimizer, distributed)
    # Returns on every rank once rank 0 wrote DCP's .metadata (its last step gathers every rank's writes).
    with _quiet(distributed):
        dcp.save(state, checkpoint_id=str(partial), no_dist=not distributed)
    final = None
    if _rank0(distributed):
        if extra is not None:
            torch.save(extra, partial / store.EXTRA)
        final = store.commit(partial, _manifest(pm, optimizer, extra is not None))
        store.prune(base, keep, final)
    if distributed:
        dist.barrier()  # every rank returns after the commit: a load right after sees it
    return final or base / store.name(box[0])


def _without_unsaved(osd: dict[str, Any], ckpt: Path) -> bool:
    """Leave out of ``osd`` the parameters checkpoint ``ckpt`` holds no optimizer state for: a parameter that had
    no gradient when it was saved (a layer forward never reads) has no state in the saved optimizer, while
    ``_optimizer_state`` gave every parameter of the loading one some (DCP's first step at learning rate 0); such a
    parameter is loaded without state, as it was saved.  Whether any was left out."""
    prefix = "optim.state."
    keys = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    # a state's name (``exp_avg``, ``step``) has no dot: what precedes its last one is the parameter's name
    saved = {k[len(prefix):].rpartition(".")[0] for k in keys if k.startswith(prefix)}
    kept = {fqn: states for fqn, states in osd["state"].items() if fqn in saved}
    left_out = len(kept) < len(osd["state"])
    osd["state"] = kept
    return left_out


@torch.no_grad()
def load(pm: Tiled, root: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Read the newest checkpoint under ``root`` (or the checkpoint ``root``), written under any plan, into
    ``pm``'s tiles and ``optimizer``'s state; returns the ``extra`` saved with it (None if none)."""
    ckpt = store.resolve(root)
    manifest = store.read_manifest(ckpt)
    distributed = _distributed(pm)
    tensors = sharded_state_dict(pm)
    if manifest is None:  # a checkpoint of an older soybean: the model's tensors at top level
        with _quiet(distributed):
            dcp.load(tensors, checkpoint_id=str(ckpt), no_dist=not distributed)
    else:
        store.check_tensors(ckpt, manifest["tensors"], _catalog(pm))
        state: dict[str, Any] = {"model": tensors}
        if optimizer is not None:
            saved = manifest["optimizer"]
            if saved is None:
                raise CheckpointError(f"checkpoint {ckpt} holds no optimizer state: it was saved without "
                                      "optimizer=; load it without one, or save with save_sharded(dir, optimizer=opt)")
            if saved != type(optimizer).__name__:
                raise CheckpointError(f"checkpoint {ckpt} holds {saved}'s state, not {type(optimizer).__name__}'s: "
                                      f"build a {saved}, or load without optimizer=")
            state["optim"] = _optimizer_state(pm, optimizer, distributed)
            some_unsaved = _without_unsaved(state["optim"], ckpt)
        with _quiet(distributed):
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=not distributed)
        if optimizer is not None:
            for states in state["optim"]["state"].values():  # this rank's tiles, as the optimizer holds them
                for k, v in states.items():
                    if isinstance(v, DTensor):
                        states[k] = v.to_local()
            set_optimizer_state_dict(pm, optimizer, state["optim"],  # type: ignore[arg-type]
                                     options=StateDictOptions(strict=not some_unsaved))
    for kind, fqn in pm._state():
        t = tensors[fqn]
        pm._tensor(kind, fqn).copy_(t.to_local() if isinstance(t, DTensor) else t)
    if manifest is None or not manifest["extra"]:
        return None
    return torch.load(ckpt / store.EXTRA, weights_only=False)  # the user's own pickle, saved by save()
