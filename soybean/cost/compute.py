"""Compute: seconds of one training step of an op, and of the optimizer step on a parameter tile.

An op's (``compute_seconds``) forward is a roofline,
``max(flops / F, bytes / mem_bw)``; its backward repeats that once per input whose
gradient is needed (a matmul's two products, an elementwise op's one pass), so
training is 1x (nothing needs a gradient) to 3x the forward.  The work is divided
by the product of the mesh axes the strategy splits.  Where a profile sets
``large_alloc``, every local tensor at least that large that the op allocates
(its outputs, and in backward the gradients of its inputs) is also charged
``bytes / alloc_bw``: fresh large allocations are page-faulted in on a CPU
(glibc maps blocks of 32 MiB and up afresh each time), which costs several
times the arithmetic on them.  Each pass also costs the profile's fixed ``op_s`` whatever its size
(dispatcher, autograd node, kernel launch: what decides the step of a deep model of small layers), not
divided by the split: every device runs every pass of its tile.

A view is free, except one the program may run as a copy of its tile (``rules.views.may_copy``: the tile's
layout need not allow the view the serial value allowed): ``copy_seconds``, the tile read and written once.

The optimizer (``optimizer_seconds``): an AdamW step on a local tile costs a fixed time per
tensor plus its bytes at the optimizer's rate (see ``OPTIMIZER_PASSES``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from .. import rules
from ..mesh import Mesh
from ..rules.base import ELEMENTWISE, OpCost, OpSpec, Strategy
from ..tiling import max_local_numel
from .profiles import Profile

# An AdamW step reads parameter, gradient and both states and writes parameter and both states:
# about 7 passes over the local tile, memory-bound (the reason split weights train faster when
# weights are large and batches small).  A calibrated profile measures it instead (optimizer_bw).
OPTIMIZER_PASSES = 7
# torch's AdamW step allocates about two parameter-sized temporaries: for a large tile they are
# page-faulted in (``Profile.large_alloc``), which a 32 MiB parameter's step shows as ~1.5x the time.
# A calibrated profile measures that rate instead (optimizer_large_bw).
OPTIMIZER_TEMPS = 2


def facts(op: OpSpec) -> OpCost:
    """The cost facts ``op``'s rule declared; an op without a rule is priced as elementwise."""
    entry = rules.lookup(op.target)
    return entry.cost if entry is not None and entry.cost is not None else ELEMENTWISE


def flops(op: OpSpec) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one forward op from its shapes."""
    out_n = math.prod(op.outputs[0].shape) if op.outputs else 0
    byts = sum(math.prod(t.shape) * t.dtype.itemsize for t in op.inputs + op.outputs)
    f = facts(op).flops
    return (f(op) if f is not None else float(out_n)), byts


def passes(op: OpSpec, grads: list[bool]) -> float:
    """Forward-equivalents of one training step of ``op`` (see ``compute_seconds``), given which of its
    tensor inputs need a gradient: a view is free; a product's backward is one product per operand
    needing a gradient; any other op's backward is its declared ``backward`` (one forward by default)."""
    c = facts(op)
    if c.view:
        return 0.0
    if c.operands is not None:
        return 1.0 + sum(1.0 for i in c.operands if i < len(grads) and grads[i])
    return 1.0 + (c.backward if any(grads) else 0.0)


def fresh_bytes(op: OpSpec, s: Strategy, grads: list[bool], mesh: Mesh, profile: Profile) -> float:
    """Local bytes of the large tensors ``op`` allocates under strategy ``s``: its outputs, and
    in backward the gradients of its inputs (only those of at least ``profile.large_alloc``)."""
    if not profile.large_alloc or facts(op).view:
        return 0.0
    big = 0.0
    for spec, t in zip(op.outputs, s.outputs):
        n = max_local_numel(spec.shape, t, mesh) * spec.dtype.itemsize
        big += n if n >= profile.large_alloc else 0.0
    for spec, t, gr in zip(op.inputs, s.inputs, grads):
        n = max_local_numel(spec.shape, t, mesh) * spec.dtype.itemsize if gr else 0
        big += n if n >= profile.large_alloc else 0.0
    return big


def optimizer_seconds(nbytes: float, profile: Profile) -> float:
    """An AdamW step on a local parameter tile of ``nbytes``: its fixed per-tensor cost plus its
    bytes at the optimizer's rate (for a large tile, with its temporaries page-faulted in)."""
    t = profile.optimizer_tensor_s
    if profile.large_alloc and nbytes >= profile.large_alloc:
        if profile.optimizer_large_bw:
            return t + nbytes / profile.optimizer_large_bw
        t += OPTIMIZER_TEMPS * nbytes / profile.alloc_bw if profile.alloc_bw else 0.0
    return t + nbytes / (profile.optimizer_bw or profile.mem_bw / OPTIMIZER_PASSES)


def compute_seconds(flops: float, bytes_moved: float, work_fraction: float, profile: Profile, passes: float = 3.0,
                    fresh_bytes: float = 0.0) -> float:
    """Time of one training step of an op: ``passes`` forward-equivalents of its roofline time
    (see the module docstring) on ``work_fraction`` of the work, plus first-touching
    ``fresh_bytes`` of large new allocations, and ``passes`` fixed costs ``op_s``."""
    t = passes * (work_fraction * max(flops / profile.flops, bytes_moved / profile.mem_bw) + profile.op_s)
    return t + (fresh_bytes / profile.alloc_bw if profile.alloc_bw and fresh_bytes else 0.0)


def work_fraction(split_axes: Sequence[bool], mesh: Mesh) -> float:
    return 1.0 / math.prod(p for p, s in zip(mesh.shape, split_axes) if s) if any(split_axes) else 1.0


def op_flops(op: OpSpec, profile: Profile) -> float:
    """The FLOP/s ``op`` runs at: ``conv_flops`` for a convolution, ``fp32_flops`` for another op on float32 inputs
    (on a GPU, without TF32, a float32 matmul runs an order of magnitude slower than a bf16 one), else ``flops``."""
    if facts(op).conv:
        return profile.conv_flops or profile.flops
    if profile.fp32_flops and op.inputs and op.inputs[0].dtype == torch.float32:
        return profile.fp32_flops
    return profile.flops


def op_seconds(
    op: OpSpec, strategies: Sequence[Strategy], grads: list[bool], mesh: Mesh, profile: Profile,
    copies: bool = False,
) -> np.ndarray:
    """Training-step seconds of ``op`` under each strategy, given which tensor inputs need a gradient; ``copies``:
    a view the program may run as a copy of its tile (``rules.views.may_copy``), priced by ``copy_seconds``."""
    n_flops, byts = flops(op)
    f = op_flops(op, profile)
    rate = profile if f == profile.flops else replace(profile, flops=f)  # a copy only for an op at another rate
    n_pass = passes(op, grads)
    skew = facts(op).skew
    seconds = np.array([compute_seconds(n_flops * (skew(op, s, mesh, profile) if skew is not None else 1.0),
                                        byts, work_fraction(s.divides_work(), mesh), rate, n_pass,
                                        fresh_bytes(op, s, grads, mesh, profile)) for s in strategies])
    return seconds + copy_seconds(op, strategies, mesh, profile) if copies else seconds


def copy_seconds(op: OpSpec, strategies: Sequence[Strategy], mesh: Mesh, profile: Profile) -> np.ndarray:
    """Seconds of a reshape that copies its tile, under each strategy: the busiest rank's output tile read and
    written once at ``mem_bw`` (a large one also first-touched: ``Profile.large_alloc``), plus one op's fixed cost.
    Forward only: the copy's backward is a view of the gradient."""
    out = op.outputs[0]
    tiles = [max_local_numel(out.shape, s.outputs[0], mesh) * out.dtype.itemsize for s in strategies]
    return np.array([compute_seconds(0.0, 2.0 * b, 1.0, profile, 1.0,
                                     b if profile.large_alloc and b >= profile.large_alloc else 0.0) for b in tiles])


def optimizer_step_seconds(
    shape: tuple[int, ...],
    itemsize: int,
    tilings: Sequence[tuple],
    mesh: Mesh,
    profile: Profile,
    trains: bool,
) -> np.ndarray:
    """Optimizer seconds of a stored tensor under each tiling (zero where it does not train)."""
    return np.array([optimizer_seconds(max_local_numel(shape, t, mesh) * itemsize, profile) if trains else 0.0
                     for t in tilings])
