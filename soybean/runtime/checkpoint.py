"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Each rank's tiles are wrapped as ``DTensor``s on a ``DeviceMesh`` of the plan's
shape (soybean's chunking is DTensor's, so ``from_local`` needs no copy), so a
checkpoint written under one plan loads under any other plan, world size or
mesh: DCP reshards.  Loading writes straight into the local parameter tiles.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ..tiling import R, to_torch


def _device_mesh(pm) -> object:
    if not dist.is_initialized():
        raise RuntimeError("sharded checkpoints need torch.distributed: run under torchrun, `soybean run` or spawn")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, tuple(pm.plan.mesh))


def sharded_state_dict(pm) -> dict[str, DTensor]:
    """Every parameter and buffer of ParallelModule ``pm`` as a DTensor viewing the local tile."""
    mesh = _device_mesh(pm)
    out: dict[str, DTensor] = {}
    for kind, fqn in pm._order:
        t = pm._tensor(kind, fqn)
        tiling = pm.plan.param_tiling(fqn) if fqn in pm.plan.params else (R,) * len(pm.plan.mesh)
        shape = pm._full_shape(fqn)
        stride = torch.empty(shape, device="meta").stride()
        out[fqn] = DTensor.from_local(t.detach(), mesh, [to_torch(p) for p in tiling], run_check=False, shape=torch.Size(shape), stride=stride)
    return out


def save(pm, path: str | Path) -> None:
    """Write ``pm``'s tiles as a DCP checkpoint (every rank writes its own shards)."""
    dcp.save(sharded_state_dict(pm), checkpoint_id=str(path))


@torch.no_grad()
def load(pm, path: str | Path) -> None:
    """Read a DCP checkpoint written under any plan into ``pm``'s tiles."""
    sd = sharded_state_dict(pm)
    dcp.load(sd, checkpoint_id=str(path))
    for kind, fqn in pm._order:  # from_local may share storage; copy to be sure
        pm._tensor(kind, fqn).copy_(sd[fqn].to_local())
