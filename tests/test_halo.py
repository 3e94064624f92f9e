"""The halo exchange (``runtime.kinds`` kind ``halo``): serial meaning and the dot-product adjoint test.

Member ``k`` of a group holds chunk ``k`` of a dim and gets rows ``[s_k, e_k)`` of the whole
(``fill`` outside it).  Forward is checked against the window cut from the serial tensor; backward
by ``sum_k <W_k x, y_k> == sum_k <x_k, (W^T y)_k>`` (``fill = 0``, so the map is linear; a
``-inf`` fill is checked in forward only).  Windows come from ``rules.window.Window`` for every
kernel / stride / padding / dilation combination of the cases, uneven tiles, tiles thinner than
the halo (rows from several members) and members whose window is all padding.  The helpers are
shared with test_dist_collectives.py, which runs the same cases over gloo processes.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from soybean.mesh import Mesh
from soybean.rules.window import Window
from soybean.runtime import run_threads, sb_halo
from soybean.tiling import chunk_range

pytestmark = pytest.mark.sim

DTYPE = torch.float64


@dataclass(frozen=True)
class HaloCase:
    """Input of ``shape`` split along ``dim``; every member reads its window of ``window``."""

    name: str
    shape: tuple[int, ...]
    window: Window
    fill: float = 0.0

    @property
    def dim(self) -> int:
        return self.window.dim

    def windows(self, p: int) -> tuple[tuple[int, int], ...]:
        return self.window.members(p)


def _conv(n: int, k: int, st: int, q: int, dil: int) -> Window:
    x = dil * (k - 1) + 1
    return Window(0, 0, n, (n + 2 * q - x) // st + 1, "conv", st, q, x)


def _cases() -> list[HaloCase]:
    out = []
    for n, k, st, q, dil in itertools.product((5, 9), (1, 3, 5), (1, 2), (0, 2), (1, 2)):
        x = dil * (k - 1) + 1
        if n + 2 * q >= x:
            out.append(HaloCase(f"conv-n{n}-k{k}-s{st}-p{q}-d{dil}", (n, 3, 2), _conv(n, k, st, q, dil)))
    out.append(HaloCase("transposed-k3-s2-p1", (5, 3, 2), Window(0, 0, 5, 9, "transposed", 2, 1, 3)))
    out.append(HaloCase("transposed-k1-s3", (5, 3, 2), Window(0, 0, 5, 13, "transposed", 3, 0, 1)))
    out.append(HaloCase("nearest-x2", (5, 3, 2), Window(0, 0, 5, 10, "nearest", 2)))
    out.append(HaloCase("conv-dim1-k3-p1", (3, 7, 2), Window(0, 1, 7, 7, "conv", 1, 1, 3)))
    out.append(HaloCase("pad-crop", (9, 3, 2), Window(0, 0, 9, 6, "conv", 1, -2, 1)))
    return out


CASES = _cases()
INF_CASE = HaloCase("maxpool-inf", (7, 3, 2), _conv(7, 3, 2, 1, 1), fill=float("-inf"))
TOPOLOGIES: list[tuple[tuple[int, ...], int]] = [((1,), 0), ((2,), 0), ((4,), 0), ((2, 2), 0), ((2, 2), 1)]


def serial_window(full: torch.Tensor, dim: int, s: int, e: int, fill: float) -> torch.Tensor:
    """Rows ``[s, e)`` of ``full`` along ``dim``, ``fill`` outside it."""
    out = full.new_full(tuple(e - s if d == dim else n for d, n in enumerate(full.shape)), fill)
    lo, hi = max(s, 0), min(e, full.shape[dim])
    if hi > lo:
        out.narrow(dim, lo - s, hi - lo).copy_(full.narrow(dim, lo, hi - lo))
    return out


def make_data(case: HaloCase, p: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The logical tensor, member tiles and window cotangents of one group."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(case.shape, dtype=DTYPE, generator=gen)
    xs = [full.narrow(case.dim, a, b - a).clone() for a, b in (chunk_range(case.shape[case.dim], p, k) for k in range(p))]
    ys = [torch.randn(serial_window(full, case.dim, s, e, 0.0).shape, dtype=DTYPE, generator=gen)
          for s, e in case.windows(p)]
    return full, xs, ys


def run_member(case: HaloCase, axis: int, p: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """One member: its window (no grad), and ``W^T y`` via autograd."""
    args = (axis, case.dim, case.shape[case.dim], case.windows(p), case.fill)
    plain = sb_halo(x.clone(), *args)
    xg = x.clone().requires_grad_()
    out = sb_halo(xg, *args)
    gx = torch.autograd.grad(out, xg, y)[0] if case.fill == 0.0 else torch.zeros_like(x)
    return plain.detach(), gx


def check_group(case: HaloCase, p: int, seed: int, plains: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    full, xs, ys = make_data(case, p, seed)
    for k, (s, e) in enumerate(case.windows(p)):
        torch.testing.assert_close(plains[k], serial_window(full, case.dim, s, e, case.fill), rtol=0, atol=0,
                                   msg=lambda m: f"{case.name} p={p} member {k}: window != serial: {m}")
    if case.fill != 0.0:
        return
    lhs = sum(float((o * y).sum()) for o, y in zip(plains, ys))
    rhs = sum(float((x * g).sum()) for x, g in zip(xs, grads))
    assert abs(lhs - rhs) <= 1e-9 * max(abs(lhs), 1.0), f"{case.name} p={p}: <Wx,y>={lhs} <x,W*y>={rhs}"


def seed_for(ci: int, group: Sequence[int]) -> int:
    return 7919 * ci + group[0]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: f"{'x'.join(map(str, t[0]))}-axis{t[1]}")
def test_halo_forward_and_adjoint(topology: tuple[tuple[int, ...], int]) -> None:
    shape, axis = topology
    mesh = Mesh(shape)
    cases = CASES + [INF_CASE]

    def member(rank: int, _groups: list) -> list:
        g = mesh.axis_group(rank, axis)
        k, p = mesh.coords(rank)[axis], len(g)
        out = []
        for ci, case in enumerate(cases):
            _, xs, ys = make_data(case, p, seed_for(ci, g))
            out.append(run_member(case, axis, p, xs[k], ys[k]))
        return out

    res = run_threads(mesh, member, timeout_s=60)
    for g in mesh.axis_groups(axis):
        for ci, case in enumerate(cases):
            plains, grads = zip(*(res[r][ci] for r in g))
            check_group(case, len(g), seed_for(ci, g), plains, grads)


def test_thin_tiles_read_several_members() -> None:
    """5 rows over 4 members (2, 2, 1, 0) with a 5-tap kernel: a window spans three owners."""
    w = _conv(5, 5, 1, 2, 1)
    wins = w.members(4)
    owners = [{j for j in range(4) if max(s, chunk_range(5, 4, j)[0]) < min(e, chunk_range(5, 4, j)[1])}
              for s, e in wins]
    assert max(len(o) for o in owners) >= 3, (wins, owners)
    assert w.sources(4) >= 2 and w.halo_rows(4) >= 2
