"""Mesh shapes searched on several processes (``soybean.planner.mesh_pool``, ``PlanOptions.jobs``).

The plan is the one the in-process search finds, whichever worker found it; a plan that leads arrives with its
table, one that cannot win without it; a mesh pruned or unfit in a worker is recorded as in-process; what a worker
sends pickles (torch ops by name, a table without the run's pricing state); a worker that fails or dies is an
error naming the fix, never a hang.
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from examples.models import mlp, transformer
from soybean.capture.core import capture
from soybean.cost.profiles import load_profile
from soybean.mesh import Mesh
from soybean.planner.mesh_pool import WorkerError, default_jobs, each_mesh
from soybean.options import PlanOptions
from soybean.planner.core import Pruned, SearchError, plan as make_plan
from soybean.planner.solve import MemoryBudgetError, Search
from soybean.rules.base import make_opspec

pytestmark = pytest.mark.unit

fork = pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(),
                          reason="no fork on this platform: jobs run in-process")


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert a.cost["step_time_s"] == b.cost["step_time_s"]
    if a.mesh != b.mesh:  # two meshes tied exactly: which a worker prunes at the tie depends on arrival order
        return
    assert a.params == b.params and a.nodes == b.nodes and a.inputs == b.inputs
    assert a.cost == b.cost and a.reshards == b.reshards and a.memory == b.memory
    assert {k: v for k, v in a.solver.items() if k != "seconds"} == {k: v for k, v in b.solver.items()
                                                                    if k != "seconds"}
    # ``meshes`` may differ: which meshes a worker prunes rather than solves depends on when plans arrive


@fork
@pytest.mark.parametrize("devices", [2, 4])
def test_two_workers_find_the_plan_one_process_finds(devices: int) -> None:
    model, inputs = transformer(batch=4, seq=16, hidden=32, layers=2, heads=4)
    cap = capture(model, inputs)
    one = make_plan(None, captured=cap, devices=devices, jobs=1, baselines=False)
    two = make_plan(None, captured=cap, devices=devices, jobs=2, baselines=False)
    _same(one, two)


@fork
def test_under_a_budget_both_passes_run_on_workers_with_the_same_answer() -> None:
    """The two-pass search under a budget (``solve_plain`` on every mesh, then recomputation where needed: both
    layers are recomputed at 90% of the free plan's memory)."""
    model, inputs = transformer(batch=8, seq=16, hidden=32, layers=2, heads=4)
    cap = capture(model, inputs)
    free = make_plan(None, captured=cap, devices=4, jobs=1, baselines=False)
    budget = 0.9 * free.cost["memory_bytes"] / 2**30 / 0.95
    one = make_plan(None, captured=cap, devices=4, memory_gb=budget, jobs=1, baselines=False)
    two = make_plan(None, captured=cap, devices=4, memory_gb=budget, jobs=2, baselines=False)
    _same(one, two)
    assert one.recompute == two.recompute and one.recompute


def _solve(m: Mesh, incumbent: float | None, say) -> float:  # type: ignore[no-untyped-def]
    say(f"start {m}")
    if m.shape == (3,):
        raise Pruned(9.0, 1.0)
    if m.shape == (5,):
        raise MemoryBudgetError(2e9, m)
    return float(m.size)


@fork
@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_each_mesh_yields_every_outcome_and_passes_progress_on(jobs: int) -> None:
    meshes = [Mesh((n,)) for n in (2, 3, 4, 5, 6)]
    said: list[str] = []
    got = dict(each_mesh(meshes, _solve, lambda r: r, lambda r: r, jobs, said.append, (SearchError,)))
    assert set(got) == set(meshes)
    assert got[Mesh((2,))] == 2.0 and got[Mesh((6,))] == 6.0
    assert isinstance(got[Mesh((3,))], Pruned) and got[Mesh((3,))].bound == 9.0
    e = got[Mesh((5,))]
    assert isinstance(e, MemoryBudgetError) and e.mesh == Mesh((5,)) and "--memory-gb" in str(e)
    assert sorted(said) == sorted(f"start {m}" for m in meshes)


def _buggy(m: Mesh, incumbent: float | None, say) -> float:  # type: ignore[no-untyped-def]
    if m.shape == (4,):
        raise KeyError("a bug")
    return 1.0


def _killed(m: Mesh, incumbent: float | None, say) -> float:  # type: ignore[no-untyped-def]
    if m.shape == (4,):
        os._exit(9)  # as the kernel's OOM killer ends a process: no message sent
    return 1.0


@fork
def test_a_worker_bug_is_raised_with_its_traceback() -> None:
    with pytest.raises(WorkerError, match="KeyError: 'a bug'"):
        list(each_mesh([Mesh((2,)), Mesh((4,))], _buggy, lambda r: r, lambda r: r, 2, lambda s: None,
                       (SearchError,)))


@fork
def test_a_worker_that_dies_is_an_error_naming_the_fix_not_a_hang() -> None:
    with pytest.raises(WorkerError, match="--jobs 1"):
        list(each_mesh([Mesh((2,)), Mesh((4,)), Mesh((8,))], _killed, lambda r: r, lambda r: r, 2, lambda s: None,
                       (SearchError,)))


def test_what_a_worker_sends_pickles() -> None:
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    op = make_opspec(torch.ops.aten.linear.default, (x, w), {}, torch.nn.functional.linear(x, w))
    back = pickle.loads(pickle.dumps(op))
    assert back.target is torch.ops.aten.linear.default and back == op
    e = pickle.loads(pickle.dumps(Pruned(2.0, 1.0)))
    assert isinstance(e, Pruned) and (e.bound, e.cutoff) == (2.0, 1.0)
    model, inputs = mlp(batch=4, hidden=8, layers=2)
    search = Search(load_profile("cpu-gloo"), PlanOptions(devices=2))
    g = search.table(capture(model, inputs), Mesh((2,)))
    h = pickle.loads(pickle.dumps(g))
    assert h.pricing is not g.pricing and not h.pricing.edges  # the run's pricing state stays behind
    assert [v.name for v in h.vars] == [v.name for v in g.vars] and len(h.edges) == len(g.edges)


_STARTED: list = []  # a multiprocessing Event, made before the fork: the waiting mesh has read the incumbent


def _first(m: Mesh, incumbent, say) -> float:  # type: ignore[no-untyped-def]
    _STARTED[0].wait(30)  # the other mesh starts before this plan is known
    return 1.0


def _waits(m: Mesh, incumbent, say) -> float:  # type: ignore[no-untyped-def]
    import time

    first = incumbent()
    _STARTED[0].set()
    for _ in range(600):  # at most 30 s
        if (now := incumbent()) is not None:
            raise Pruned(5.0, now) if first is None else SearchError("the incumbent was known before the start")
        time.sleep(0.05)
    raise SearchError("never saw the other worker's plan")


@fork
def test_a_worker_sees_another_workers_plan_while_it_searches() -> None:
    """The incumbent is read live (``incumbent()``): a mesh started before another worker's plan arrived is pruned
    by that plan as soon as it reads it, not only the meshes started after."""
    import multiprocessing

    _STARTED[:] = [multiprocessing.get_context("fork").Event()]
    got = dict(each_mesh([Mesh((2,)), Mesh((4,))], lambda m, inc, say: (_first if m.shape == (2,) else _waits)(
        m, inc, say), lambda r: r, lambda r: r, 2, lambda s: None, (SearchError,)))
    assert got[Mesh((2,))] == 1.0
    e = got[Mesh((4,))]
    assert isinstance(e, Pruned) and e.cutoff == 1.0, e


def test_meshes_are_tried_in_the_order_of_what_their_parents_reached() -> None:
    """``planner.by_promise``: a 3-axis mesh ranks by the better, then the worse, of the two 2-axis meshes that
    merge a pair of its neighbouring axes; ties and meshes with no parent searched keep their order."""
    from soybean.planner.core import by_promise

    m = lambda *s: Mesh(s)  # noqa: E731
    estimate = {m(16, 8): 0.8, m(2, 64): 2.0, m(4, 32): 1.0, m(8, 16): 1.0, m(32, 4): 3.0}
    meshes = [m(2, 8, 8), m(4, 4, 8), m(2, 4, 16), m(2, 2, 32), m(4, 8, 4), m(8, 2, 8)]
    # parents: 2x8x8: 16x8 0.8, 2x64 2.0 | 4x4x8: 16x8 0.8, 4x32 1.0 | 2x4x16: 8x16 1.0, 2x64 2.0
    # 2x2x32: 4x32 1.0, 2x64 2.0 | 4x8x4: 32x4 3.0, 4x32 1.0 | 8x2x8: 16x8 0.8, 8x16 1.0
    assert by_promise(meshes, estimate) == [m(4, 4, 8), m(8, 2, 8), m(2, 8, 8), m(2, 4, 16), m(2, 2, 32),
                                            m(4, 8, 4)]
    assert by_promise(meshes, {}) == meshes


def test_jobs_left_to_choose_stay_in_process_for_small_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOYBEAN_JOBS", raising=False)
    assert default_jobs(50, 10) == 1
    assert 1 <= default_jobs(10_000, 3) <= 3
    monkeypatch.setenv("SOYBEAN_JOBS", "3")
    assert default_jobs(50, 10) == 3
    with pytest.raises(ValueError, match="--jobs"):
        PlanOptions(jobs=0)


def _mip(m: Mesh, incumbent: float | None, say) -> float:  # type: ignore[no-untyped-def]
    from soybean.search.formulation import formulate
    from soybean.search.highs import solve_formulation as _run

    status, _, bound = _run(formulate(_knapsack()), True, 30.0, 0.0)
    assert status == "optimal"
    return bound


def _knapsack():  # type: ignore[no-untyped-def]
    """A budgeted problem whose LP relaxation is fractional: branch and bound runs (HiGHS's thread scheduler)."""
    import numpy as np

    from soybean.search.problem import Problem

    rng = np.random.default_rng(0)
    n = 40
    unary = [np.array([0.0, float(c)]) for c in rng.random(n) * 10]
    memory = [np.array([float(w), 0.0]) for w in rng.random(n) * 7 + 1]
    return Problem(unary, {}, memory, float(n), [f"v{i}" for i in range(n)])


@fork
def test_branch_and_bound_runs_in_a_worker_forked_after_the_parent_ran_it() -> None:
    """A fork copies HiGHS's thread scheduler but not its threads: without a fresh scheduler in the worker, its
    branch and bound waited forever for them."""
    import signal

    def hung(*_: object) -> None:
        raise TimeoutError("a worker's branch and bound hung (HiGHS's scheduler copied by the fork)")

    here = _mip(Mesh((1,)), None, None)
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)  # a hang fails the test (the workers are killed on the way out), never the suite
    try:
        got = dict(each_mesh([Mesh((2,)), Mesh((4,))], _mip, lambda r: r, lambda r: None, 2, lambda s: None,
                             (SearchError,)))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert got == {Mesh((2,)): here, Mesh((4,)): here}


_ORPHAN_SCRIPT = """
import os, sys, time
from soybean.mesh import Mesh
from soybean.planner.mesh_pool import each_mesh

def solve(m, live, say):
    open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
    time.sleep(120)

list(each_mesh([Mesh((2,)), Mesh((4,))], solve, lambda r: r, lambda r: None, 2, lambda s: None, ()))
"""


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@fork
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_workers_end_when_the_planner_is_killed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A planner killed outright (a timeout's SIGKILL, the out-of-memory killer) runs no cleanup: its workers must
    not search on, orphaned, holding the cores (``mesh_pool._die_with``)."""
    import signal
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(tmp_path)], cwd=root)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            pids = [int(p) for p in os.listdir(tmp_path)]
            time.sleep(0.1)
        assert len(pids) == 2, "the workers never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a worker outlived the planner that forked it"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
