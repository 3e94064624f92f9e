"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Each rank's tiles are wrapped as ``DTensor``s on a ``DeviceMesh`` of the plan's
shape (soybean's chunking is DTensor's, so ``from_local`` needs no copy), so a
checkpoint written under one plan loads under any other plan, world size or
mesh: DCP reshards.  Loading writes straight into the local parameter tiles.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..plan import Plan
from ..tiling import to_torch


class Tiled(Protocol):
    """What a checkpoint reads of a ``ParallelModule``: a protocol, so that the runtime never imports
    ``soybean.module`` (which imports the runtime)."""

    plan: Plan

    def _state(self) -> Iterator[tuple[str, str]]: ...  # (kind, fqn) of every parameter and buffer

    def _tensor(self, kind: str, fqn: str) -> torch.Tensor: ...

    def _full_shape(self, fqn: str) -> tuple[int, ...]: ...


def _device_mesh(pm: Tiled) -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("sharded checkpoints need torch.distributed: run under torchrun, `soybean run` or spawn")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, tuple(pm.plan.mesh))


def sharded_state_dict(pm: Tiled) -> dict[str, DTensor]:
    """Every parameter and buffer of ParallelModule ``pm`` as a DTensor viewing the local tile."""
    mesh = _device_mesh(pm)
    out: dict[str, DTensor] = {}
    for kind, fqn in pm._state():
        t = pm._tensor(kind, fqn)
        tiling = pm.plan.param_tiling(fqn)
        shape = pm._full_shape(fqn)
        stride = torch.empty(shape, device="meta").stride()
        out[fqn] = DTensor.from_local(t.detach(), mesh, [to_torch(p) for p in tiling], run_check=False,
                                      shape=torch.Size(shape), stride=stride)
    return out


def save(pm: Tiled, path: str | Path) -> None:
    """Write ``pm``'s tiles as a DCP checkpoint (every rank writes its own shards)."""
    dcp.save(sharded_state_dict(pm), checkpoint_id=str(path))


@torch.no_grad()
def load(pm: Tiled, path: str | Path) -> None:
    """Read a DCP checkpoint written under any plan into ``pm``'s tiles."""
    sd = sharded_state_dict(pm)
    dcp.load(sd, checkpoint_id=str(path))
    for kind, fqn in pm._state():  # from_local may share storage; copy to be sure
        pm._tensor(kind, fqn).copy_(sd[fqn].to_local())
