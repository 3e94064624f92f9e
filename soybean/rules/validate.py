"""Check a rule against the serial op by simulating every device in one process.

For each N-D strategy of an op: cut the full inputs into tiles (``Partial`` inputs
into random summands), run the op on every device's tiles with localized
arguments, reassemble the outputs and compare them with the serial output.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..mesh import Mesh, all_coords
from ..tiling import Partial, Placement, R, Replicate, assemble, local_shape, shard
from .base import OpSpec, Strategy, expand, lookup, make_opspec


def shard_exact(
    full: torch.Tensor, tiling: tuple[Placement, ...], mesh: Mesh, gen: torch.Generator
) -> dict[tuple[int, ...], torch.Tensor]:
    """Every device's tile of ``full``, ``Partial`` summands summing exactly to it.

    (``tiling.shard`` keeps the whole value on every non-first summand, so its
    partial tiles sum to ``p`` times the tensor; cut ``S``/``R`` there, split here.)
    """
    tiles = shard(full, tuple(R if isinstance(p, Partial) else p for p in tiling), mesh)
    rnd = full.is_floating_point() or full.is_complex()
    for axis, pl in enumerate(tiling):
        if not isinstance(pl, Partial):
            continue
        drawn: dict[tuple[int, ...], list[torch.Tensor]] = {}  # replicas (differing on R axes) share summands
        for coords in [c for c in tiles if c[axis] == 0]:
            base = tiles[coords]
            key = tuple(0 if isinstance(t, Replicate) else c for t, c in zip(tiling, coords))
            noise = drawn.setdefault(key, [
                torch.randn(base.shape, generator=gen, dtype=base.dtype) if rnd else torch.zeros_like(base)
                for _ in range(1, mesh.shape[axis])
            ])
            tiles[coords] = base - sum(noise, torch.zeros_like(base))
            tiles.update((coords[:axis] + (k,) + coords[axis + 1:], n.clone()) for k, n in enumerate(noise, 1))
    return tiles


def run_local(
    op: OpSpec,
    target: Any,
    args: tuple,
    kwargs: dict,
    strategy: Strategy,
    mesh: Mesh,
    gen: torch.Generator,
) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Every device's output tiles of ``target`` under ``strategy``."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tiles = [shard_exact(leaves[i], t, mesh, gen) for i, t in zip(tensor_pos, strategy.inputs)]
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


_TWO_WAY = Mesh((2,))  # check_op's default mesh (immutable, so one shared instance is safe)


def check_op(
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    mesh: Mesh = _TWO_WAY,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    seed: int = 0,
) -> int:
    """Validate every strategy of ``target(*args, **kwargs)`` on ``mesh``; returns how many were checked.

    Raises ``AssertionError`` naming the op and strategy whose reassembled output
    differs from the serial output.
    """
    kwargs = kwargs or {}
    # The serial reference runs on copies: in-place ops (relu_, add_, batch-norm
    # running stats) must not change the inputs the tiles are cut from.
    fresh = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    expected = target(*tree_map(fresh, tuple(args)), **tree_map(fresh, dict(kwargs)))
    op = make_opspec(target, args, kwargs, expected)
    exp_leaves = [o for o in tree_flatten(expected)[0] if isinstance(o, torch.Tensor)]
    strategies = expand(op, mesh)
    gen = torch.Generator().manual_seed(seed)
    for st in strategies:
        tiles = run_local(op, target, args, kwargs, st, mesh, gen)
        where = (
            f"{op.name} strategy in={[list(map(str, t)) for t in st.inputs]} "
            f"out={[list(map(str, t)) for t in st.outputs]} on mesh {mesh}"
        )
        for j, (exp, tiling) in enumerate(zip(exp_leaves, st.outputs)):
            for c, ts in tiles.items():  # tiles must be DTensor chunks, not just concatenate right
                want = local_shape(tuple(exp.shape), tiling, mesh, c)
                if tuple(ts[j].shape) != want:
                    raise AssertionError(
                        f"{where}: output {j} tile of device {c} is {tuple(ts[j].shape)}, not its chunk {want}"
                    )
            scale = float(exp.abs().max() if exp.numel() and exp.is_floating_point() else 1)
            got = assemble({c: ts[j] for c, ts in tiles.items()}, tiling, mesh, check_replicas=atol * 10 + rtol * scale)
            if got.shape != exp.shape or not torch.allclose(
                got.to(exp.dtype), exp, rtol=rtol, atol=atol, equal_nan=True
            ):
                if got.shape == exp.shape:
                    diff: object = (got.double() - exp.double()).abs().max().item()
                else:
                    diff = f"shape {tuple(got.shape)} != {tuple(exp.shape)}"
                raise AssertionError(f"{where}: output {j} wrong ({diff})")
    return len(strategies)
