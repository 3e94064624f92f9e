"""Collectives on the thread tier: serial meaning, adjointness, failure modes.

Every primitive is the identity on the logical tensor, so its forward is checked
by reassembling the members' outputs (tiling.assemble) and comparing with the
full tensor.  Its backward is checked to be the adjoint with the dot-product
test ``<F x, y> == <x, F* y>``, where the inner product of a placement is

* S, P, and R with partial gradients (grad_partial outputs, grad_to_partial
  inputs): ``sum_k <a_k, b_k>`` over the members;
* R with replicated gradients: ``<a_0, b_0>`` (and all members must agree).

The helpers here (CASES, make_data, run_member, check_group) are shared with
test_dist_collectives.py, which runs the same cases over gloo processes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import pytest
import torch

from soybean.mesh import Mesh
from soybean.runtime import (ThreadWorld, current_groups, run_threads, sb_all_gather, sb_all_reduce, sb_all_to_all,
                             sb_grad_all_reduce, sb_grad_to_partial, sb_reduce_scatter, sb_shard, sb_to_partial, use_groups)
from soybean.runtime import collectives as C
from soybean.tiling import P, Placement, R, Replicate, S, Shard, assemble, chunk_range, local_shape

pytestmark = pytest.mark.sim

# Uneven on purpose: over 4 members dim 0 (7) splits 2,2,2,1 and dim 1 (5) splits 2,2,1,0
# (an empty tile); over 2 members 4,3 and 3,2.
SHAPE = (7, 5, 3)
DTYPE = torch.float64


@dataclass(frozen=True)
class Case:
    """One primitive with fixed dims; ``call(x, axis)`` runs it through the sb_* wrapper."""

    name: str
    src: Placement
    dst: Placement
    call: Callable[[torch.Tensor, int], torch.Tensor]
    grad_partial: bool = False  # the output's gradient is a per-member summand (R consumed by split work)
    in_grad_partial: bool = False  # the input's gradient is a per-member summand (its producer sums them)

    @property
    def replicated_cotangent(self) -> bool:
        """R (without grad_partial) and P outputs get the same gradient on every member."""
        return not self.grad_partial and not isinstance(self.dst, Shard)

    @property
    def out_pairs_member0(self) -> bool:
        return isinstance(self.dst, Replicate) and not self.grad_partial

    @property
    def in_pairs_member0(self) -> bool:
        return isinstance(self.src, Replicate) and not self.in_grad_partial


CASES: list[Case] = [
    Case("shard_slice_d0", R, S(0), lambda x, a: sb_shard(x, a, 0)),
    Case("shard_slice_d1", R, S(1), lambda x, a: sb_shard(x, a, 1)),
    Case("all_gather_d0", S(0), R, lambda x, a: sb_all_gather(x, a, 0, SHAPE[0], False)),
    Case("all_gather_d1", S(1), R, lambda x, a: sb_all_gather(x, a, 1, SHAPE[1], False)),
    Case("all_gather_d0_gp", S(0), R, lambda x, a: sb_all_gather(x, a, 0, SHAPE[0], True), grad_partial=True),
    Case("all_gather_d1_gp", S(1), R, lambda x, a: sb_all_gather(x, a, 1, SHAPE[1], True), grad_partial=True),
    Case("all_reduce", P, R, lambda x, a: sb_all_reduce(x, a)),
    Case("reduce_scatter_d0", P, S(0), lambda x, a: sb_reduce_scatter(x, a, 0)),
    Case("reduce_scatter_d1", P, S(1), lambda x, a: sb_reduce_scatter(x, a, 1)),
    Case("all_to_all_0to1", S(0), S(1), lambda x, a: sb_all_to_all(x, a, 0, 1, SHAPE[0])),
    Case("all_to_all_1to0", S(1), S(0), lambda x, a: sb_all_to_all(x, a, 1, 0, SHAPE[1])),
    Case("all_to_all_2to0", S(2), S(0), lambda x, a: sb_all_to_all(x, a, -1, 0, SHAPE[2])),
    Case("to_partial", R, P, lambda x, a: sb_to_partial(x, a)),
    Case("grad_all_reduce", R, R, lambda x, a: sb_grad_all_reduce(x, a), grad_partial=True),
    Case("grad_to_partial", R, R, lambda x, a: sb_grad_to_partial(x, a), in_grad_partial=True),
]

# (mesh shape, axis): 1-D worlds of 1, 2, 4 and both axes of a 2x2 mesh.
TOPOLOGIES: list[tuple[tuple[int, ...], int]] = [((1,), 0), ((2,), 0), ((4,), 0), ((2, 2), 0), ((2, 2), 1)]


@dataclass
class Data:
    """One axis group's inputs: the logical tensor, member tiles ``xs`` and cotangents ``ys``."""

    full: torch.Tensor
    xs: list[torch.Tensor]
    ys: list[torch.Tensor]


def seed_for(case_index: int, group: Sequence[int]) -> int:
    """Deterministic in every process (no ``hash``), different per case and group."""
    return 1000 * case_index + group[0]


def split(full: torch.Tensor, pl: Placement, p: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Member tiles of ``full`` under ``pl``: chunks, copies, or random summands.

    (Not tiling.shard: its Partial summands currently add up to p * full.)
    """
    if isinstance(pl, Shard):
        return [full.narrow(pl.dim, a, b - a).clone() for a, b in (chunk_range(full.shape[pl.dim], p, k) for k in range(p))]
    if isinstance(pl, Replicate):
        return [full.clone() for _ in range(p)]
    noise = [torch.randn(full.shape, dtype=full.dtype, generator=gen) for _ in range(p - 1)]
    return [full - sum(noise, torch.zeros_like(full)), *noise]


def make_data(case: Case, p: int, seed: int) -> Data:
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(SHAPE, dtype=DTYPE, generator=gen)
    line = Mesh((p,))
    xs = split(full, case.src, p, gen)
    out_shapes = [local_shape(SHAPE, (case.dst,), line, (k,)) for k in range(p)]
    if case.replicated_cotangent:
        ys = [torch.randn(out_shapes[0], dtype=DTYPE, generator=gen)] * p
    else:
        ys = [torch.randn(s, dtype=DTYPE, generator=gen) for s in out_shapes]
    return Data(full, xs, ys)


def run_member(case: Case, axis: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One member: forward without grad, forward with grad, and ``F* y`` via autograd."""
    plain = case.call(x.clone(), axis)
    xg = x.clone().requires_grad_()
    out = case.call(xg, axis)
    (gx,) = torch.autograd.grad(out, xg, y)
    return plain.detach(), out.detach(), gx


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], member0: bool) -> float:
    pairs = list(zip(a, b))[:1] if member0 else zip(a, b)
    return sum(float((u * v).sum()) for u, v in pairs)


def _assert_replicas(ts: Sequence[torch.Tensor], what: str) -> None:
    for k, t in enumerate(ts[1:], 1):
        torch.testing.assert_close(t, ts[0], rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: member {k} differs: {m}")


def check_group(case: Case, data: Data, plains: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor]) -> None:
    """Serial meaning, no-grad == grad forward, and the dot-product adjoint test for one group."""
    p = len(outs)
    for a, b in zip(plains, outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    logical = assemble({(k,): o for k, o in enumerate(outs)}, (case.dst,), Mesh((p,)), check_replicas=1e-12)
    torch.testing.assert_close(logical, data.full, msg=lambda m: f"{case.name} p={p}: forward != serial: {m}")
    if case.in_pairs_member0:
        _assert_replicas(grads, f"{case.name} p={p} replicated gradient")
    for x, g in zip(data.xs, grads):
        assert g.shape == x.shape, f"{case.name}: gradient shape {tuple(g.shape)} != input {tuple(x.shape)}"
    lhs = _dot(outs, data.ys, case.out_pairs_member0)
    rhs = _dot(data.xs, grads, case.in_pairs_member0)
    assert abs(lhs - rhs) <= 1e-5 * max(abs(lhs), abs(rhs), 1.0), f"{case.name} p={p}: <Fx,y>={lhs} <x,F*y>={rhs}"


# ---- thread tier --------------------------------------------------------------------


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: f"{'x'.join(map(str, t[0]))}-axis{t[1]}")
@pytest.mark.parametrize("ci", range(len(CASES)), ids=[c.name for c in CASES])
def test_forward_and_adjoint(ci: int, topology: tuple[tuple[int, ...], int]) -> None:
    case, (shape, axis) = CASES[ci], topology
    mesh = Mesh(shape)
    groups = mesh.axis_groups(axis)
    data = {tuple(g): make_data(case, len(g), seed_for(ci, g)) for g in groups}

    def member(rank: int, _groups: list) -> tuple:
        k = mesh.coords(rank)[axis]
        d = data[tuple(mesh.axis_group(rank, axis))]
        return run_member(case, axis, d.xs[k], d.ys[k])

    res = run_threads(mesh, member, timeout_s=30)
    for g in groups:
        plains, outs, grads = zip(*(res[r] for r in g))
        check_group(case, data[tuple(g)], plains, outs, grads)


def test_group_of_one_is_identity() -> None:
    """Size-1 groups skip the Function entirely: the very same tensor comes back."""
    (group,) = ThreadWorld(Mesh((1,))).groups(0)
    x = torch.randn(SHAPE, dtype=DTYPE, requires_grad=True)
    with use_groups([group]):
        for case in CASES:
            assert case.call(x, 0) is x, case.name
    for fn, args in [(C.shard_slice, (0,)), (C.all_gather, (0, SHAPE[0])), (C.all_reduce, ()), (C.reduce_scatter, (1,)),
                     (C.all_to_all, (0, 1, SHAPE[0])), (C.to_partial, ()), (C.grad_all_reduce, ()),
                     (C.grad_to_partial, ())]:
        assert fn(x, group, *args) is x, fn.__name__


def test_serial_meaning_by_hand() -> None:
    """A readable spot check of the chunk rule: 7 rows over 4 members are 2,2,2,1."""
    full = torch.arange(7.0)

    def member(rank: int, groups: list) -> tuple:
        mine = sb_shard(full, 0, 0)
        return mine, sb_all_gather(mine, 0, 0, 7), sb_reduce_scatter(full, 0, 0)

    res = run_threads(Mesh((4,)), member)
    assert [r[0].tolist() for r in res] == [[0, 1], [2, 3], [4, 5], [6]]
    assert all(torch.equal(r[1], full) for r in res)
    assert [r[2].tolist() for r in res] == [[0, 4], [8, 12], [16, 20], [24]]


# ---- failure modes ------------------------------------------------------------------


def test_missing_rank_times_out() -> None:
    def member(rank: int, groups: list) -> None:
        if rank == 0:  # rank 1 skips the collective
            sb_all_reduce(torch.ones(3), 0)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"mesh axis 0 timed out after 0.3 s: a rank died or ranks disagree"):
        run_threads(Mesh((2,)), member, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0


def test_failing_rank_wakes_the_others() -> None:
    """A rank raising outside a collective must not leave the others waiting for the timeout."""
    def member(rank: int, groups: list) -> None:
        if rank == 3:
            raise ValueError("boom on rank 3")
        sb_all_reduce(torch.ones(3), 1)  # 2x2 mesh: rank 2 (axis 1) and rank 1 (axis 0) wait for rank 3
        sb_all_reduce(torch.ones(3), 0)

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 3"):
        run_threads(Mesh((2, 2)), member, timeout_s=30)
    assert time.monotonic() - t0 < 2.0


def test_ranks_disagreeing_on_the_program() -> None:
    def member(rank: int, groups: list) -> None:
        x = torch.ones(4, 2)
        sb_all_reduce(x, 0) if rank == 0 else sb_all_gather(x[2 * rank - 2:2 * rank], 0, 0, 4)

    with pytest.raises(RuntimeError, match="ranks disagree on the program"):
        run_threads(Mesh((2,)), member, timeout_s=5)


def test_wrong_tile_length_is_reported() -> None:
    def member(rank: int, groups: list) -> None:
        sb_all_gather(torch.ones(3, 2), 0, 0, 7)  # chunk 1 of 7 over 2 has 3 rows, chunk 0 has 4

    with pytest.raises(ValueError, match="member 0 of 2 holds 3 along dim 0"):
        run_threads(Mesh((2,)), member, timeout_s=5)


def test_no_current_groups() -> None:
    with pytest.raises(RuntimeError, match="no soybean process groups are set"):
        current_groups()
    with pytest.raises(RuntimeError, match="no soybean process groups are set"):
        sb_all_reduce(torch.ones(1), 0)
