"""Check a rule against the serial op by simulating every device in one process.

For each N-D strategy of an op: cut the full inputs into tiles (``Partial`` inputs
into random summands), run the op on every device's tiles with localized
arguments, reassemble the outputs and compare them with the serial output.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..mesh import Mesh, all_coords
from ..tiling import assemble, local_shape, shard
from .base import OpSpec, Strategy, expand, lookup, make_opspec


def run_local(op: OpSpec, target: Any, args: tuple, kwargs: dict, strategy: Strategy, mesh: Mesh, gen: torch.Generator) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Every device's output tiles of ``target`` under ``strategy``."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tiles = [shard(leaves[i], t, mesh, gen) for i, t in zip(tensor_pos, strategy.inputs)]
    entry = lookup(target)
    result: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for coords in all_coords(mesh):
        local = list(leaves)
        for i, tl in zip(tensor_pos, tiles):
            local[i] = tl[coords]
        a, k = tree_unflatten(local, spec)
        if entry is not None and entry.localize is not None:
            in_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.inputs, strategy.inputs)]
            out_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.outputs, strategy.outputs)]
            a, k = entry.localize(op, a, k, in_shapes, out_shapes)
        out, _ = tree_flatten(target(*a, **k))
        result[coords] = [o for o in out if isinstance(o, torch.Tensor)]
    return result


def check_op(target: Any, args: tuple, kwargs: dict | None = None, mesh: Mesh = Mesh((2,)), *, rtol: float = 1e-5, atol: float = 1e-5, seed: int = 0) -> int:
    """Validate every strategy of ``target(*args, **kwargs)`` on ``mesh``; returns how many were checked.

    Raises ``AssertionError`` naming the op and strategy whose reassembled output
    differs from the serial output.
    """
    kwargs = kwargs or {}
    expected = target(*args, **kwargs)
    op = make_opspec(target, args, kwargs, expected)
    exp_leaves = [o for o in tree_flatten(expected)[0] if isinstance(o, torch.Tensor)]
    strategies = expand(op, mesh)
    gen = torch.Generator().manual_seed(seed)
    for st in strategies:
        tiles = run_local(op, target, args, kwargs, st, mesh, gen)
        for j, (exp, tiling) in enumerate(zip(exp_leaves, st.outputs)):
            got = assemble({c: ts[j] for c, ts in tiles.items()}, tiling, mesh, check_replicas=atol * 10 + rtol * float(exp.abs().max() if exp.numel() and exp.is_floating_point() else 1))
            if got.shape != exp.shape or not torch.allclose(got.to(exp.dtype), exp, rtol=rtol, atol=atol, equal_nan=True):
                diff = (got.double() - exp.double()).abs().max().item() if got.shape == exp.shape else f"shape {tuple(got.shape)} != {tuple(exp.shape)}"
                raise AssertionError(f"{op.name} strategy in={[list(map(str, t)) for t in st.inputs]} out={[list(map(str, t)) for t in st.outputs]} on mesh {mesh}: output {j} wrong ({diff})")
    return len(strategies)
