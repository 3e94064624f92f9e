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
from ..runtime.launch import run_threads
from ..tiling import Partial, Placement, R, Replicate, assemble, local_shape, shard
from .base import OpSpec, Strategy, expand, lookup, make_opspec
from .window import Window, crops, halos, local_rows, windows_of


def cut_window(x: torch.Tensor, split: list[tuple[int, Window]], mesh: Mesh, coords: tuple[int, ...]) -> torch.Tensor:
    """The rows of ``x`` (whole along the windowed dims) that the device at ``coords`` reads, the op's fill
    outside the tensor: what the halo exchange delivers."""
    for axis, w in split:
        s, e = w.members(mesh.shape[axis])[coords[axis]]
        out = x.new_full(tuple(e - s if d == w.dim else n for d, n in enumerate(x.shape)), w.fill)
        lo, hi = max(s, 0), min(e, x.shape[w.dim])
        if hi > lo:
            out.narrow(w.dim, lo - s, hi - lo).copy_(x.narrow(w.dim, lo, hi - lo))
        x = out
    return x


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
    """Every device's output tiles of ``target`` under ``strategy``; a windowed input is cut whole along its
    split dims, then each device's window of it (``cut_window``), and the outputs cropped (``window.crops``)."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    split = halos(windows_of(op), strategy)
    tiles = []
    for slot, (i, t) in enumerate(zip(tensor_pos, strategy.inputs)):
        mine = [(axis, w) for axis, w in split if w.slot == slot]
        whole = tuple(R if any(axis == a for a, _ in mine) else pl for axis, pl in enumerate(t))
        tl = shard_exact(leaves[i], whole, mesh, gen)
        tiles.append({c: cut_window(x, mine, mesh, c) for c, x in tl.items()} if mine else tl)
    entry = lookup(target)
    sync = entry.sync_args(op, strategy) if entry is not None and entry.sync_args is not None else {}

    def device(coords: tuple[int, ...]) -> list[torch.Tensor]:
        local = list(leaves)
        for i, tl in zip(tensor_pos, tiles):
            local[i] = tl[coords]
        a, k = tree_unflatten(local, spec)
        if entry is not None and entry.localize is not None:
            in_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.inputs, strategy.inputs)]
            out_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.outputs, strategy.outputs)]
            a, k = entry.localize(op, a, k, in_shapes, out_shapes)
        if split and entry is not None and entry.window_args is not None:
            a, k = entry.window_args(op, a, k, local_rows(split, mesh, coords))
        fn = target
        if sync and entry is not None and entry.sync_call is not None:
            fn, k = entry.sync_call, {**k, **sync}
        out, _ = tree_flatten(fn(*a, **k))
        outs = [o for o in out if isinstance(o, torch.Tensor)]
        for dim, start, length in crops(split, mesh, coords):
            outs[0] = outs[0].narrow(dim, start, length)
        return outs

    if sync:  # the devices sum statistics: run them as threads of one ThreadWorld
        ranks = run_threads(mesh, lambda rank, groups: device(mesh.coords(rank)), timeout_s=60)
        return {mesh.coords(r): outs for r, outs in enumerate(ranks)}
    return {coords: device(coords) for coords in all_coords(mesh)}


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
