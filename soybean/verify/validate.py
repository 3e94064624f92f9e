"""Check a rule against the serial op by simulating every device in one process.

For each N-D strategy of an op: cut the full inputs into tiles (``Partial`` inputs
into random summands), run the op on every device's tiles with localized
arguments, reassemble the outputs and compare them with the serial output.  Then
backward: each device's output tiles get their share of one random gradient of the
serial outputs (``cotangent_tiling``), backward runs through each device's own op,
and the input gradients, assembled as the generated program's adjoint collectives
combine them (``gradient_tiling``), must equal the serial op's gradients.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..mesh import Mesh, all_coords
from ..rules.base import OpSpec, Strategy, expand, lookup, make_opspec
from ..rules.window import Window, crops, halos, local_rows, windows_of
from ..runtime.launch import run_threads
from ..runtime.synced import SYNC_CALLS
from ..tiling import Partial, Placement, R, Replicate, Shard, assemble, local_shape, shard


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


def magnitude(t: torch.Tensor) -> float:
    """The largest finite absolute value of ``t`` (0 when it has none): the scale its tolerances are relative to
    (a mask's infinities, or the NaNs of uninitialised memory, set none)."""
    if not t.numel():
        return 0.0
    a = t.abs()
    if a.is_floating_point():  # non-finite entries count as 0 (abs is >= 0): no boolean-mask gather, 2x faster
        a = torch.where(torch.isfinite(a), a, 0.0)
    return float(a.max())


NOISE_CAP = 1e6  # summands of a huge value (a mask's dtype minimum) stay far from overflow
SATURATED = 1e-6  # values within this fraction of the dtype's largest may overflow in a device's summand


def noise_cap(tensors: Sequence[Any]) -> float:
    """The largest summand noise of a ``Partial`` input that stays finite when the op multiplies it by the largest
    finite value among ``tensors`` (its inputs): a mask's dtype minimum times a summand of 1 plus noise overflows to
    ``inf`` on one device and ``-inf`` on another, a ``nan`` the exact sum never makes (LED's sliding-window mask,
    ``ones @ mask``)."""
    ratio = 0.0  # the largest finite magnitude among the inputs, as a fraction of its dtype's largest
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            ratio = max(ratio, magnitude(t.detach()) / float(torch.finfo(t.dtype).max))
    return NOISE_CAP if ratio == 0.0 else min(NOISE_CAP, 1.0 / (ratio * 1e3))


def shard_exact(
    full: torch.Tensor, tiling: tuple[Placement, ...], mesh: Mesh, gen: torch.Generator, cap: float = NOISE_CAP
) -> dict[tuple[int, ...], torch.Tensor]:
    """Every device's tile of ``full``, ``Partial`` summands summing exactly to it.

    (``tiling.shard`` keeps the whole value on every non-first summand, so its
    partial tiles sum to ``p`` times the tensor; cut ``S``/``R`` there, split here.)
    """
    tiles = shard(full, tuple(R if isinstance(p, Partial) else p for p in tiling), mesh)
    rnd = full.is_floating_point() or full.is_complex()
    # Summands of each element's own size (at least the value's typical size, at most NOISE_CAP): noise larger
    # than an element would leave the sum its rounding error at the noise's scale (a float32 op then looks
    # inexact by that much; a mask's dtype minimum beside small scores set a scale of 1e308 for all).
    typical = 1.0
    if rnd and any(isinstance(p, Partial) for p in tiling):  # only summands need it (the median is a sort)
        a = full.abs()
        ok = torch.isfinite(a)
        finite = (a if bool(ok.all()) else a[ok]).double()  # no boolean gather where every value is finite
        median = float(finite.detach().median()) if finite.numel() else 0.0
        typical = median if median > 0 else (magnitude(full) or 1.0)

    def size(x: torch.Tensor) -> torch.Tensor:
        a = x.abs().to(torch.float64)
        return torch.where(torch.isfinite(a), a.clamp(min=min(typical, cap), max=cap), min(typical, cap))

    for axis, pl in enumerate(tiling):
        if not isinstance(pl, Partial):
            continue
        drawn: dict[tuple[int, ...], list[torch.Tensor]] = {}  # replicas (differing on R axes) share summands
        for coords in [c for c in tiles if c[axis] == 0]:
            base = tiles[coords]
            key = tuple(0 if isinstance(t, Replicate) else c for t, c in zip(tiling, coords))
            noise = drawn.setdefault(key, [
                torch.randn(base.shape, generator=gen, dtype=base.dtype) * size(base).to(base.real.dtype)
                if rnd else torch.zeros_like(base) for _ in range(1, mesh.shape[axis])
            ])
            tiles[coords] = base - sum(noise, torch.zeros_like(base))
            tiles.update((coords[:axis] + (k,) + coords[axis + 1:], n.clone()) for k, n in enumerate(noise, 1))
    return tiles


Tiles = dict[tuple[int, ...], list[torch.Tensor]]


def run_local(
    op: OpSpec,
    target: Any,
    args: tuple,
    kwargs: dict,
    strategy: Strategy,
    mesh: Mesh,
    gen: torch.Generator,
    cotangents: Tiles | None = None,
    differentiable: list[bool] | None = None,
) -> Tiles | tuple[Tiles, dict[tuple[int, ...], list[torch.Tensor] | str]]:
    """Every device's output tiles of ``target`` under ``strategy``; a windowed input is cut whole along its
    split dims, then each device's window of it (``cut_window``), and the outputs cropped (``window.crops``).

    With ``cotangents`` (each device's gradient of each output tile), also each device's gradient of each
    input tile (zeros where it gets none), by backward through the device's own run: ``(outputs, grads)``;
    a device whose backward fails gives its error instead.  ``differentiable`` (per tensor input) says which
    inputs take a gradient (default: the floating ones).  An input cut whole along a windowed dim gets its
    gradient on that whole tensor (what the halo's adjoint adds back)."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    split = halos(windows_of(op), strategy)
    tiles = []
    cap = noise_cap([leaves[i] for i in tensor_pos])
    for slot, i in enumerate(tensor_pos):
        tiles.append(shard_exact(leaves[i], input_tiling(op, strategy, slot, split), mesh, gen, cap))
    entry = lookup(target)
    sync = entry.sync_args(op, strategy) if entry is not None and entry.sync_args is not None else {}

    wants = differentiable or [_differentiable(leaves[i]) for i in tensor_pos]

    def device(coords: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor] | str]:
        local = list(leaves)
        grad_of: list[torch.Tensor] = []
        for slot, (i, tl) in enumerate(zip(tensor_pos, tiles)):
            x = tl[coords]
            if cotangents is not None and wants[slot]:
                x = x.detach().requires_grad_(True)
            grad_of.append(x)
            mine = [(axis, w) for axis, w in split if w.slot == slot]
            # a clone: in-place ops may then update it although the leaf requires a gradient
            local[i] = cut_window(x, mine, mesh, coords) if mine else x.clone() if x.requires_grad else x
        a, k = tree_unflatten(local, spec)
        if entry is not None and entry.localize is not None:
            in_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.inputs, strategy.inputs)]
            out_shapes = [local_shape(s.shape, t, mesh, coords) for s, t in zip(op.outputs, strategy.outputs)]
            a, k = entry.localize(op, a, k, in_shapes, out_shapes)
        if split and entry is not None and entry.window_args is not None:
            a, k = entry.window_args(op, a, k, local_rows(split, mesh, coords))
        fn = target
        if sync and entry is not None and entry.sync_call is not None:
            fn, k = SYNC_CALLS[entry.sync_call], {**k, **sync}
        with torch.set_grad_enabled(cotangents is not None):
            out, _ = tree_flatten(fn(*a, **k))
        outs = [o for o in out if isinstance(o, torch.Tensor)]
        for dim, start, length in crops(split, mesh, coords):
            outs[0] = outs[0].narrow(dim, start, length)
        if cotangents is None:
            return outs, []
        try:
            return [o.detach() for o in outs], vjp(outs, grad_of, cotangents[coords])
        except RuntimeError as e:  # a wrong strategy can make backward itself fail (a gradient of another shape)
            return [o.detach() for o in outs], f"backward failed: {str(e).splitlines()[0]}"

    if sync:  # the devices sum statistics: run them as threads of one ThreadWorld
        ranks = run_threads(mesh, lambda rank, groups: device(mesh.coords(rank)), timeout_s=60)
        res = {mesh.coords(r): o for r, o in enumerate(ranks)}
    else:
        res = {coords: device(coords) for coords in all_coords(mesh)}
    outs = {c: o for c, (o, _) in res.items()}
    return outs if cotangents is None else (outs, {c: g for c, (_, g) in res.items()})


def _differentiable(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def vjp(outs: list[torch.Tensor], inputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of ``sum <outs, cotangents>`` with respect to each input (zeros where none flows)."""
    pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
    wrt = [x for x in inputs if x.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True) if pairs and wrt \
        else [None] * len(wrt)
    it = iter(got)
    return [(g if (g := next(it)) is not None else torch.zeros_like(x)) if x.requires_grad else torch.zeros_like(x)
            for x in inputs]


def input_tiling(op: OpSpec, strategy: Strategy, slot: int, split: list[tuple[int, Window]]) -> tuple[Placement, ...]:
    """How input ``slot``'s tile is cut: its strategy tiling, whole (``R``) along the mesh axes that split one of
    its windowed dims (the device then reads its window of rows)."""
    mine = {axis for axis, w in split if w.slot == slot}
    return tuple(R if axis in mine else pl for axis, pl in enumerate(strategy.inputs[slot]))


def gradient_tiling(tiling: tuple[Placement, ...], strategy: Strategy) -> tuple[Placement, ...]:
    """How the devices' gradients of an input tile of ``tiling`` make the full gradient (the adjoint's
    placements, as the generated program's collectives treat them): a shard's gradient is that shard; a
    replicated input of an op that splits its work on the axis gets a partial sum there (Megatron's ``f``:
    summed by the backward all-reduce), else the whole gradient; a pending sum's every summand gets the
    whole gradient."""
    split = strategy.split_axes()
    return tuple(pl if isinstance(pl, Shard) else Partial() if isinstance(pl, Replicate) and split[a] else R
                 for a, pl in enumerate(tiling))


def cotangent_tiling(tiling: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The placements of an output tile's gradient: a shard's, or the whole gradient (a replicated output
    receives it whole, and every summand of a pending sum receives the whole gradient of the sum)."""
    return tuple(pl if isinstance(pl, Shard) else R for pl in tiling)


def mismatch(got_tiles: dict[tuple[int, ...], torch.Tensor], tiling: tuple[Placement, ...], mesh: Mesh,
             expected: torch.Tensor, rtol: float, atol: float) -> str | None:
    """Why the devices' tiles do not make ``expected``; None when they do.  Each tile must be its DTensor chunk,
    replicas must agree, and the assembled tensor must match to ``atol + rtol * |expected|``."""
    for c, t in got_tiles.items():  # tiles must be DTensor chunks, not just concatenate right
        want = local_shape(tuple(expected.shape), tiling, mesh, c)
        if tuple(t.shape) != want:
            return f"tile of device {c} is {tuple(t.shape)}, not its chunk {want}"
    floating = expected.is_floating_point() or expected.is_complex()
    scale = magnitude(expected) if floating else 1.0
    try:
        got = assemble(got_tiles, tiling, mesh, check_replicas=atol * 10 + rtol * scale)
    except AssertionError as e:
        return str(e)
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    got = got.to(expected.dtype)
    if floating and scale > SATURATED * float(torch.finfo(expected.dtype).max):
        # Values at the edge of the dtype's range (a mask's dtype minimum, summed or multiplied): summands of a
        # pending sum can overflow where their sum does not (inf - inf on two devices), so elements either side
        # leaves non-finite are not compared; every finite one still is.
        finite = torch.isfinite(got) & torch.isfinite(expected)
        got, expected = got[finite], expected[finite]
    if not torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True):
        return f"max diff {(got.double() - expected.double()).abs().max().item():.3g} (scale {scale:.3g})"
    return None


def describe(op: OpSpec, st: Strategy, mesh: Mesh) -> str:
    """A strategy as error messages name it."""
    return (f"{op.name} strategy in={[list(map(str, t)) for t in st.inputs]} "
            f"out={[list(map(str, t)) for t in st.outputs]} on mesh {mesh}")


def tensor_arg_names(target: Any, args: tuple, kwargs: dict) -> list[str]:
    """The schema name of the argument each tensor leaf of ``(args, kwargs)`` belongs to, in flatten order."""
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    out: list[str] = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"arg{i}"
        out += [name] * sum(isinstance(x, torch.Tensor) for x in tree_flatten(a)[0])
    for k, v in kwargs.items():
        out += [k] * sum(isinstance(x, torch.Tensor) for x in tree_flatten(v)[0])
    return out


_NOT_DIFFERENTIABLE = re.compile(r"not differentiable with respect to argument '(\w+)'")


class Reference:
    """The serial op on full arguments: its outputs and, for a random gradient of its floating outputs, the
    gradient of each tensor input that takes one (``differentiable``; None for the backward when the op has
    no differentiable path)."""

    def __init__(self, target: Any, args: tuple, kwargs: dict, gen: torch.Generator, backward: bool = True) -> None:
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        names = tensor_arg_names(target, args, kwargs)
        self.differentiable = [backward and _differentiable(leaves[i]) for i in pos]
        while True:
            # The serial reference runs on copies: in-place ops (relu_, add_, batch-norm running stats) must not
            # change the inputs the tiles are cut from.
            ins = [leaves[i].detach().clone().requires_grad_(d) for i, d in zip(pos, self.differentiable)]
            local = list(leaves)
            for i, x in zip(pos, ins):
                local[i] = x.clone() if x.requires_grad else x
            a, k = tree_unflatten(local, spec)
            try:
                with torch.set_grad_enabled(backward):
                    result = target(*a, **k)
                break
            except RuntimeError as e:  # an argument that takes no gradient (nll_loss's weight): leave it out
                m = _NOT_DIFFERENTIABLE.search(str(e))
                if not any(self.differentiable):
                    raise
                if m is None or m.group(1) not in names:  # autograd refuses the op: check its forward only
                    backward = False
                    self.differentiable = [False] * len(pos)
                else:
                    self.differentiable = [d and n != m.group(1) for d, n in zip(self.differentiable, names)]
        self.result = result
        outs = [o for o in tree_flatten(result)[0] if isinstance(o, torch.Tensor)]
        self.outputs = [o.detach() for o in outs]
        self.cotangents: list[torch.Tensor] | None = None
        self.grads: list[torch.Tensor] | None = None
        if backward and any(o.requires_grad for o in outs):
            self.cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if _differentiable(o)
                               else torch.zeros_like(o) for o in outs]
            try:
                self.grads = vjp(outs, ins, self.cotangents)
            except RuntimeError:  # no derivative for this op: only its forward is checked
                self.cotangents = None


def check_strategy(op: OpSpec, target: Any, args: tuple, kwargs: dict, st: Strategy, mesh: Mesh,
                   ref: Reference, gen: torch.Generator, rtol: float, atol: float) -> list[str]:
    """What is wrong with one strategy: each output, then (with ``ref.cotangents``) each input's gradient."""
    cot = None
    if ref.cotangents is not None:
        cut = [shard(c, cotangent_tiling(t), mesh) for c, t in zip(ref.cotangents, st.outputs)]
        cot = {coords: [c[coords] for c in cut] for coords in all_coords(mesh)}
    res = run_local(op, target, args, kwargs, st, mesh, gen, cotangents=cot, differentiable=ref.differentiable)
    outs, grads = res if isinstance(res, tuple) else (res, None)
    where = describe(op, st, mesh)
    bad = []
    for j, (exp, tiling) in enumerate(zip(ref.outputs, st.outputs)):
        scale = magnitude(exp) if exp.is_floating_point() or exp.is_complex() else 0.0
        why = mismatch({c: ts[j] for c, ts in outs.items()}, tiling, mesh, exp, rtol, atol + rtol * scale)
        if why is not None:
            bad.append(f"{where}: output {j} wrong ({why})")
    if grads is not None and ref.grads is not None and not bad:
        failed = next((g for g in grads.values() if isinstance(g, str)), None)
        if failed is not None:
            return [f"{where}: {failed}"]
        split = halos(windows_of(op), st)
        tensors = {c: g for c, g in grads.items() if not isinstance(g, str)}
        for i, exp in enumerate(ref.grads):
            if not ref.differentiable[i]:
                continue
            tiling = gradient_tiling(input_tiling(op, st, i, split), st)
            why = mismatch({c: g[i] for c, g in tensors.items()}, tiling, mesh, exp, rtol,
                           atol + rtol * magnitude(exp))
            if why is not None:
                bad.append(f"{where}: gradient of input {i} wrong ({why})")
    return bad


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
    backward: bool = True,
) -> int:
    """Validate every strategy of ``target(*args, **kwargs)`` on ``mesh``, forward and (``backward``) the
    gradient of every floating input; returns how many strategies were checked.

    Raises ``AssertionError`` naming the op and strategy whose reassembled output or gradient differs from
    the serial op's.
    """
    kwargs = kwargs or {}
    gen = torch.Generator().manual_seed(seed)
    ref = Reference(target, args, kwargs, gen, backward)
    op = make_opspec(target, args, kwargs, ref.result)
    strategies = expand(op, mesh)
    for st in strategies:
        bad = check_strategy(op, target, args, kwargs, st, mesh, ref, gen, rtol, atol)
        if bad:
            raise AssertionError(bad[0])
    return len(strategies)
