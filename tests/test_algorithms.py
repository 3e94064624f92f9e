"""Collective algorithms (``runtime.algorithms``: lp, ring, tree) on the thread tier: every one is the same
collective as the backend's, and its Function's backward is the exact adjoint (dot-product test), at world
sizes 1, 2, 3, 4 and on both axes of a 2x2 mesh, with uneven and empty tiles (``test_collectives.SHAPE``
splits 7 rows as 2,2,2,1 and 5 as 2,2,1,0 over 4 members).  The cost terms are checked against the
module's table and the lp chunk count against a brute-force minimum."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from soybean.mesh import Mesh
from soybean.runtime import run_threads, sb_all_gather, sb_all_reduce, sb_grad_all_reduce, sb_reduce_scatter, sb_shard
from soybean.runtime import algorithms as A
from soybean.runtime import collectives as C
from soybean.tiling import P, R, S
from test_collectives import SHAPE, Case, check_group, make_data, run_member, seed_for

pytestmark = pytest.mark.sim

TOPOLOGIES: list[tuple[tuple[int, ...], int]] = [((1,), 0), ((2,), 0), ((3,), 0), ((4,), 0), ((2, 2), 0), ((2, 2), 1)]
# lp with 3 chunks pipelines (and leaves a chunk empty on the smallest tiles); ring and tree take no chunk count.
RUNS: list[A.Algo] = [("lp", 3), ("lp", 1), ("ring", 1), ("tree", 1)]


def algo_cases(a: A.Algo) -> list[Case]:
    """The collective-running cases of ``test_collectives.CASES``, forward and adjoint both run with ``a``."""
    kw = {"algo": a, "back": a}
    return [
        Case("shard_slice_d1", R, S(1), lambda x, ax: sb_shard(x, ax, 1, back=a)),
        Case("all_gather_d0", S(0), R, lambda x, ax: sb_all_gather(x, ax, 0, SHAPE[0], False, **kw)),
        Case("all_gather_d1_gp", S(1), R, lambda x, ax: sb_all_gather(x, ax, 1, SHAPE[1], True, **kw),
             grad_partial=True),
        Case("all_reduce", P, R, lambda x, ax: sb_all_reduce(x, ax, a)),
        Case("reduce_scatter_d0", P, S(0), lambda x, ax: sb_reduce_scatter(x, ax, 0, **kw)),
        Case("reduce_scatter_d1", P, S(1), lambda x, ax: sb_reduce_scatter(x, ax, 1, **kw)),
        Case("grad_all_reduce", R, R, lambda x, ax: sb_grad_all_reduce(x, ax, a), grad_partial=True),
    ]


IDS = [c.name for c in algo_cases(A.BACKEND_ALGO)]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: f"{'x'.join(map(str, t[0]))}-axis{t[1]}")
@pytest.mark.parametrize("run", RUNS, ids=lambda a: f"{a[0]}{a[1]}")
def test_every_algorithm_is_the_collective_and_its_adjoint(run: A.Algo, topology: tuple[tuple[int, ...], int]) -> None:
    shape, axis = topology
    mesh = Mesh(shape)
    cases = algo_cases(run)
    data = {(ci, tuple(g)): make_data(c, len(g), seed_for(ci, g)) for ci, c in enumerate(cases)
            for g in mesh.axis_groups(axis)}

    def member(rank: int, _groups: list) -> list[tuple]:
        k, grp = mesh.coords(rank)[axis], tuple(mesh.axis_group(rank, axis))
        return [run_member(c, axis, data[(ci, grp)].xs[k], data[(ci, grp)].ys[k]) for ci, c in enumerate(cases)]

    res = run_threads(mesh, member, timeout_s=60)
    for ci, case in enumerate(cases):
        for g in mesh.axis_groups(axis):
            plains, outs, grads = zip(*(res[r][ci] for r in g))
            check_group(case, data[(ci, tuple(g))], plains, outs, grads)


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return sum(float((u * v).sum()) for u, v in zip(a, b))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("run", [A.BACKEND_ALGO, *RUNS], ids=lambda a: f"{a[0]}{a[1]}")
def test_broadcast_and_reduce_are_adjoint(run: A.Algo, p: int) -> None:
    """broadcast from ``root`` and reduce to ``root``: serial meaning, and ``<F x, y> = <x, F* y>`` summed over
    members on both sides (the non-roots' broadcast input is not read: its gradient must be zero)."""
    root = p - 1
    gen = torch.Generator().manual_seed(p)
    xs = [torch.randn(SHAPE, dtype=torch.float64, generator=gen) for _ in range(p)]
    ys = [torch.randn(SHAPE, dtype=torch.float64, generator=gen) for _ in range(p)]

    def member(rank: int, groups: list) -> tuple:
        out = []
        for fn in (C.broadcast, C.reduce):
            x = xs[rank].clone().requires_grad_()
            y = fn(x, groups[0], root, run, run)
            (gx,) = torch.autograd.grad(y, x, ys[rank])
            out.append((y.detach(), gx))
        return tuple(out)

    res = run_threads(Mesh((p,)), member, timeout_s=30)
    total = sum(xs)
    for k in range(p):
        torch.testing.assert_close(res[k][0][0], xs[root], rtol=0, atol=0)  # broadcast moves bytes only
        torch.testing.assert_close(res[k][1][0], total if k == root else torch.zeros_like(total))
        if k != root:
            assert not res[k][0][1].any(), "a non-root's broadcast input got a gradient"
    for i in range(2):
        lhs = _dot([r[i][0] for r in res], ys)
        rhs = _dot(xs, [r[i][1] for r in res])
        assert abs(lhs - rhs) <= 1e-9 * max(abs(lhs), 1.0), (i, lhs, rhs)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_all_reduce_replicas_agree_bitwise(p: int) -> None:
    """Every sum is formed once and copied: the replicas of an all-reduce are bit-for-bit equal."""
    xs = [torch.randn(101, generator=torch.Generator().manual_seed(j)) for j in range(p)]
    for run in RUNS:
        outs = run_threads(Mesh((p,)), lambda rank, groups: A.all_reduce(groups[0], xs[rank], run))
        assert all(torch.equal(o, outs[0]) for o in outs), run


def test_cost_terms_follow_the_table() -> None:
    m, p, k = 8e6, 4, 5
    table = {
        ("broadcast", "lp"): (p - 2 + k, (p - 2 + k) * m / k),
        ("broadcast", "tree"): (2, 2 * m),
        ("broadcast", "ring"): (2 * (p - 1), 2 * (p - 1) / p * m),
        ("all_reduce", "lp"): (2 * p - 3 + k, (2 * p - 3 + k) * 2 * m / k),
        ("all_reduce", "ring"): (2 * (p - 1), 2 * (p - 1) / p * m),
        ("all_reduce", "tree"): (2, 2 * m),
        ("all_gather", "ring"): (p - 1, (p - 1) / p * m),
        ("all_gather", "lp"): (p - 1, (p - 1) * 2 * m / p),
        ("reduce_scatter", "tree"): (4, ((p - 1) / p + 2) * m),
    }
    for (coll, algo), want in table.items():
        assert np.allclose(A.terms(coll, algo, m, p, k), want), (coll, algo)
    assert np.allclose(A.terms("all_reduce", "tree", m, 3), (3, 3 * m))  # 3 folds onto 2: 1 + 1 + 1 rounds
    assert all(np.allclose(A.terms(c, a, m, 1), (0, 0)) for c in A.COLLECTIVES for a in A.ALGORITHMS)


@pytest.mark.parametrize("collective", ["broadcast", "all_reduce"])
def test_lp_chunks_minimise_the_lp_cost(collective: str) -> None:
    alpha, beta = 2e-4, 1 / 1.8e9
    for m, p in itertools.product([4e3, 1e6, 64e6], [2, 3, 4, 8, 64]):
        k = int(A.lp_chunks(collective, m, p, alpha, beta))
        cost = lambda kk: float(np.dot(A.terms(collective, "lp", m, p, kk), (alpha, beta)))  # noqa: E731
        best = min(range(1, A.MAX_CHUNKS + 1), key=cost)
        assert cost(k) <= cost(best) * (1 + 1e-12), (m, p, k, best)


def test_unknown_algorithm_is_named() -> None:
    with pytest.raises(ValueError, match="unknown collective algorithm 'pipelined'.*lp, ring, tree"):
        run_threads(Mesh((2,)), lambda rank, groups: A.all_reduce(groups[0], torch.ones(3), ("pipelined", 1)))


def test_adjoint_pairs_are_symmetric() -> None:
    """The table of adjoints: broadcast and reduce, all-gather and reduce-scatter are each other's."""
    assert set(A.ADJOINT) == set(A.COLLECTIVES)
    for c, d in A.ADJOINT.items():
        assert d is None or A.ADJOINT[d] == c
    assert A.ADJOINT["broadcast"] == "reduce" and A.ADJOINT["all_gather"] == "reduce_scatter"
