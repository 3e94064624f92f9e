"""The same cases as test_collectives.py and test_halo.py over real gloo processes (TorchGroup).

Each spawn costs seconds, so every adjoint case runs inside ONE spawn: the ranks
return their local outputs and gradients, and the parent rebuilds the same
deterministic data and runs the checks.  The 4-process run (a 4-rank line and
both axes of a 2x2 mesh, i.e. sub-groups) takes about 5 s on 2 cores and is
opt-in: set SOYBEAN_TEST_DIST4=1.
"""
from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from soybean.mesh import Mesh
from soybean.runtime import TorchGroup, spawn, torch_groups, use_groups
import test_halo as H
from test_algorithms import RUNS, algo_cases
from test_collectives import CASES, check_group, make_data, run_member, seed_for

pytestmark = pytest.mark.dist

Key = tuple[tuple[int, ...], int, Any]  # (mesh shape, axis, case index or (algorithm, case index))


def _adjoint_worker(rank: int, world: int, mesh_shapes: list[tuple[int, ...]]) -> dict[Key, tuple]:
    """One rank: run every case on every axis of every mesh; return local (plain, out, grad)."""
    results: dict[Key, tuple] = {}
    for shape in mesh_shapes:
        mesh = Mesh(shape)
        groups = torch_groups(mesh)
        coords = mesh.coords(rank)
        assert all(isinstance(g, TorchGroup) and g.index == c for g, c in zip(groups, coords))
        with use_groups(groups):
            for axis in range(mesh.ndim):
                members = mesh.axis_group(rank, axis)
                for ci, case in enumerate(CASES):
                    d = make_data(case, len(members), seed_for(ci, members))
                    results[(shape, axis, ci)] = run_member(case, axis, d.xs[coords[axis]], d.ys[coords[axis]])
                for run in RUNS:  # soybean's own algorithms on point-to-point messages (runtime.algorithms)
                    for ci, case in enumerate(algo_cases(run)):
                        d = make_data(case, len(members), seed_for(ci, members))
                        results[(shape, axis, (run, ci))] = run_member(case, axis, d.xs[coords[axis]],
                                                                       d.ys[coords[axis]])
                for hi, hcase in enumerate(H.CASES + [H.INF_CASE]):  # the halo exchange: point to point
                    _, xs, ys = H.make_data(hcase, len(members), H.seed_for(hi, members))
                    k = coords[axis]
                    results[(shape, axis, -1 - hi)] = H.run_member(hcase, axis, len(members), xs[k], ys[k])
    return results


def _check_all(results: list[dict[Key, tuple]], mesh_shapes: list[tuple[int, ...]]) -> int:
    """Regroup the ranks' results per axis group and check each; returns how many groups were checked."""
    checked = 0
    for shape in mesh_shapes:
        mesh = Mesh(shape)
        for axis in range(mesh.ndim):
            for members in mesh.axis_groups(axis):
                for ci, case in enumerate(CASES):
                    plains, outs, grads = zip(*(results[r][(shape, axis, ci)] for r in members))
                    check_group(case, make_data(case, len(members), seed_for(ci, members)), plains, outs, grads)
                    checked += 1
                for run in RUNS:
                    for ci, case in enumerate(algo_cases(run)):
                        plains, outs, grads = zip(*(results[r][(shape, axis, (run, ci))] for r in members))
                        check_group(case, make_data(case, len(members), seed_for(ci, members)), plains, outs, grads)
                        checked += 1
                for hi, hcase in enumerate(H.CASES + [H.INF_CASE]):
                    hplains, hgrads = zip(*(results[r][(shape, axis, -1 - hi)] for r in members))
                    H.check_group(hcase, len(members), H.seed_for(hi, members), hplains, hgrads)
                    checked += 1
    return checked


@pytest.mark.parametrize("nproc, mesh_shapes", [
    pytest.param(2, [(2,)], id="2proc-line"),
    pytest.param(4, [(4,), (2, 2)], id="4proc-line-and-2x2", marks=pytest.mark.skipif(
        os.environ.get("SOYBEAN_TEST_DIST4") != "1", reason="about 5 s; set SOYBEAN_TEST_DIST4=1")),
])
def test_adjoint_over_gloo(nproc: int, mesh_shapes: list[tuple[int, ...]]) -> None:
    results = spawn(_adjoint_worker, nproc, mesh_shapes, timeout_s=120)
    assert _check_all(results, mesh_shapes) > 0


def _fail_worker(rank: int, world: int) -> Any:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: only spawn's fail-fast ends this
    return None


def test_failing_rank_fails_spawn_fast() -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed") as info:
        spawn(_fail_worker, 2, timeout_s=60)
    assert "ValueError: deliberate failure on rank 1" in str(info.value)  # the rank's own traceback
    assert time.monotonic() - t0 < 15.0


def _sum_worker(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def test_spawn_survives_its_port_taken_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port found free and bound later can be taken in between by another job's sockets (two gloo runs at
    once): here it is taken for sure, and ``spawn``'s rendezvous must not depend on it."""
    import socket

    import soybean.runtime.launch as launch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1])
        assert spawn(_sum_worker, 2, timeout_s=60) == [3.0, 3.0]
