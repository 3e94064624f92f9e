"""What is priced is what runs: the collectives a generated program runs in one training step equal,
kind by kind and byte by byte, the collectives the cost model priced for its plan.

Every plan of the serial-equivalence suite is trained for one step (forward and backward) with every
rank as a thread, through groups that log each collective call: its kind, its mesh axis and its
message ``m`` in the cost model's sense (the full result of an all-gather, the full input of a
reduce-scatter, the local buffer of an all-reduce or all-to-all).  The ranks run the same calls on
each axis in the same order, so the calls are aligned across ranks and each call's message is the
largest over ranks, as the cost model prices uneven tiles (``max_local_numel``).

The priced list is read from the plan's planning graph (``graph.build(fixed=plan)``): every edge's
route and the forward and backward collectives ``cost.collectives.priced_steps`` gives it, on axes of
more than one device, and every op's own communication (``Var.op_comm``): its halo exchanges (the
busiest member's received rows, forward and backward) and batch norm's statistics all-reduces (routed experts'
all-to-alls move as many rows as the routing sends: ``tests/test_experts.py`` checks them under balanced routing).  Every priced collective must run exactly once with exactly its bytes, and
nothing else may run, except that the deferred parameter-gradient all-reduces are bucketed by the
runtime (``GradSync``): those must add up, per axis, to the bytes priced for them.  A collective the plan
runs by one of soybean's own algorithms (``plan.reshards``, ``runtime.algorithms``) is logged once, as that
collective, and must run the algorithm the plan recorded for it.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from soybean.api import parallelize
from soybean.capture.core import capture
from soybean.cost.collectives import op_comm_calls, priced_steps
from soybean.cost.profiles import load_profile
from soybean.graph import build
from soybean.mesh import Mesh
from soybean.plan import Plan
from soybean.planner.core import plan as make_plan
from soybean.reshard import Route
from soybean.runtime import algorithms as A
from soybean.runtime.comm import Group
from soybean.runtime.launch import run_threads
from soybean.tiling import max_local_numel
from examples.models import resnet, unet
from tests.test_equivalence import CASES as EQUIVALENCE_CASES
from tests.test_equivalence import MODELS as EQUIVALENCE_MODELS

pytestmark = pytest.mark.sim

# The equivalence suite's plans, the batch-norm ResNet's of tests/test_cnn.py (its running
# statistics are written back to their stored tiles), and a U-Net's at batch 1 (halo exchanges, batch
# norm's summed statistics; 12 rows over 3 members: uneven windows).  Not its forced-DP plan on 2x2: that plan takes
# a forbidden resharding of a pinned parameter, so its recorded cost is the 1e30 penalty, not bytes.
def _causal() -> tuple[torch.nn.Module, tuple]:
    """One head of causal attention over a batch of one sequence: under ``comm`` its query rows split (the keys and
    values gathered whole by their edges, the mask offset in the op)."""
    from tests.test_context_parallel import CausalAttention

    torch.manual_seed(0)
    return CausalAttention(), (torch.randn(1, 30, 16),)


MODELS = {**EQUIVALENCE_MODELS, "resnet": lambda: resnet(batch=4, image=32, width=0.125, classes=10),
          "unet": lambda: unet(batch=1, image=12, channels=2), "causal": _causal}
CASES = EQUIVALENCE_CASES + [("resnet", (2,), "auto"), ("resnet", (2, 2), "auto"), ("unet", (3,), "auto"),
                             ("unet", (2, 2), "auto"), ("causal", (2,), "auto"), ("causal", (2, 2), "auto")]

Call = tuple[str, int, int]  # (collective, mesh axis, message bytes)
Run = tuple[str, int, int, str]  # a Call with its phase, forward or backward


def _phase() -> str:
    """Whether the collective being run is a forward one or an adjoint, read from the autograd ``Function`` method
    that called it (``runtime.collectives``: a recomputed layer's forward reruns during backward, as forward);
    outside those, the gradient sync is backward and a returned loss's sum forward."""
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_filename.endswith(os.path.join("runtime", "collectives.py")) and code.co_name in ("forward",
                                                                                                    "backward"):
            return code.co_name
        if code.co_filename.endswith(os.path.join("runtime", "gradsync.py")):
            return "backward"
        f = f.f_back
    return "forward"


class Recorder:
    """A group that logs every collective it runs (as ``Call``) and delegates it to ``inner``."""

    def __init__(self, inner: Group, axis: int, log: list[Run]) -> None:
        self.inner, self.axis, self.log = inner, axis, log
        self.size, self.index = inner.size, inner.index

    def _note(self, kind: str, t: torch.Tensor, numel: int | None = None) -> None:
        self.log.append((kind, self.axis, (t.numel() if numel is None else numel) * t.element_size(), _phase()))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._note("all_reduce", t)
        return self.inner.all_reduce(t)

    def all_gather(self, t: torch.Tensor, dim: int, full: int) -> torch.Tensor:
        out = self.inner.all_gather(t, dim, full)
        self._note("all_gather", out)
        return out

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        self._note("reduce_scatter", t)
        return self.inner.reduce_scatter(t, dim)

    def all_to_all(self, t: torch.Tensor, src_dim: int, dst_dim: int, full_src: int) -> torch.Tensor:
        self._note("all_to_all", t)
        return self.inner.all_to_all(t, src_dim, dst_dim, full_src)

    def exchange(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
                 like: torch.Tensor) -> dict[int, torch.Tensor]:
        got = self.inner.exchange(sends, recv_shapes, like)  # a halo exchange: the bytes I receive
        self._note("halo", like, sum(t.numel() for t in got.values()))
        return got


@contextlib.contextmanager
def algorithms_logged(ran: list[tuple[Run, str]]) -> Iterator[None]:
    """Every collective run by one of soybean's own algorithms logged once (as the collective, on the
    Recorder's axis) with its algorithm; its point-to-point rounds run on the Recorder's inner group."""
    originals = {name: getattr(A, name) for name in ("all_reduce", "all_gather", "reduce_scatter")}

    def wrap(name: str) -> Any:
        def run(group: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
            algo = args[-1]
            if algo[0] == A.BACKEND or not isinstance(group, Recorder):
                return originals[name](group, x, *args)
            out = originals[name](group.inner, x, *args)
            call = (name, group.axis, (out if name == "all_gather" else x).numel() * x.element_size(), _phase())
            group.log.append(call)
            ran.append((call, algo[0]))
            return out
        return run

    for name in originals:
        setattr(A, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(A, name, fn)


def run_one_step(model: torch.nn.Module, inputs: tuple, plan: Plan, cap: Any) -> list[Call]:
    """One forward and backward on every rank; the calls aligned across ranks, each with its largest message.
    Each collective run by one of soybean's algorithms must run the one the plan recorded for it."""
    mesh = Mesh(tuple(plan.mesh))
    logs: list[list[Run]] = [[] for _ in range(mesh.size)]
    by_algorithm: list[tuple[Run, str]] = []

    def rank_fn(rank: int, groups: list) -> None:
        rec = [Recorder(g, a, logs[rank]) for a, g in enumerate(groups)]
        pm = parallelize(model, inputs, plan=plan, rank=rank, groups=rec, captured=cap)
        out = pm(*inputs)
        out.backward()
        float(out)  # the loss sum may be pending until read

    with algorithms_logged(by_algorithm):
        run_threads(mesh, rank_fn)
    recorded = plan.algorithms()

    def planned(call: Run) -> str:  # a smaller tile of an uneven split: the record of the largest one
        fits = [(m, algo) for (c, a, m, ph), (algo, _) in recorded.items()
                if (c, a, ph) == (call[0], call[1], call[3]) and m >= call[2]]
        return min(fits)[1] if fits else A.BACKEND

    for call, algorithm in by_algorithm:
        assert planned(call) == algorithm, f"{call} ran {algorithm}, the plan says {planned(call)}"
    calls: list[Run] = []
    for axis in range(mesh.ndim):
        per_rank = [[c for c in log if c[1] == axis] for log in logs]
        assert len({len(p) for p in per_rank}) == 1, f"ranks ran different numbers of collectives on axis {axis}"
        for same in zip(*per_rank):
            assert len({(c[0], c[3]) for c in same}) == 1, \
                f"ranks ran different collectives together on axis {axis}: {same}"
            calls.append((same[0][0], axis, max(c[2] for c in same), same[0][3]))
    # ... and every collective the plan says runs by one of soybean's algorithms did, on every rank.
    assert len(by_algorithm) == mesh.size * sum(recorded.get(c, (A.BACKEND, 1))[0] != A.BACKEND for c in calls)
    return [(c, a, m) for c, a, m, _ in calls]


def priced(cap: Any, plan: Plan) -> tuple[list[Call], Counter[int], float]:
    """(collectives priced outside the gradient sync, sync bytes priced per axis, bytes sent per device)."""
    mesh = Mesh(tuple(plan.mesh))
    g = build(cap, mesh, load_profile(plan.profile), fixed=plan)
    calls: list[Call] = []
    sync: Counter[int] = Counter()
    for e in g.edges:
        route = e.route(0, 0)
        again = list(priced_steps(Route.of(route.src, route.dst))) if e.rerun else []  # a recomputed layer's read
        for kind, axis, tiling, is_sync in list(priced_steps(route)) + again:
            if mesh.shape[axis] == 1:
                continue
            m = max_local_numel(e.shape, tiling, mesh) * e.itemsize
            if is_sync and e.deferred:
                sync[axis] += m
            else:
                calls.append((kind, axis, m))
    inside = 0.0
    grads: dict[int, list[bool]] = {}
    rerun: set[int] = set()  # ops of recomputed layers: their reads are rerun
    for e in g.edges:
        if not e.write_back:
            grads.setdefault(e.dst, []).append(e.needs_grad)  # edges are in input order
        if e.rerun:
            rerun.add(e.dst)
    for vi, v in enumerate(g.vars):  # communication inside ops: halo exchanges, summed statistics, own moves
        if v.op is not None and v.op_comm is not None:
            calls += [(c.kind, c.axis, int(c.bytes)) for c in op_comm_calls(v.op, v.strategies[0], grads[vi], mesh,
                                                                               rerun=vi in rerun)]
            inside += float(v.op_comm[0, 0])
    return calls, sync, float(sum(e.bytes[0, 0] for e in g.edges)) + inside


@pytest.mark.parametrize("name,mesh,mode", CASES, ids=[f"{n}-{'x'.join(map(str, m))}-{md}" for n, m, md in CASES])
def test_collectives_run_equal_collectives_priced(name: str, mesh: tuple, mode: str) -> None:
    model, inputs = MODELS[name]()
    cap = capture(model, inputs)
    plan = make_plan(None, (), captured=cap, devices=Mesh(mesh).size, mesh=mesh, mode=mode, objective="comm",
                     baselines=False)
    want, want_sync, comm_bytes = priced(cap, plan)
    # The fixed graph prices the plan as the planner did: the plan's own record of its bytes.
    assert comm_bytes == pytest.approx(plan.cost["comm_bytes"], rel=1e-5, abs=1e-6)
    ran = Counter(run_one_step(model, inputs, plan, cap))
    assert all(r["algorithm"] in A.ALGORITHMS for r in plan.reshards)
    missing = Counter(want) - ran
    assert not missing, f"priced but not run: {dict(missing)}"
    extra = ran - Counter(want)
    assert all(kind == "all_reduce" for kind, _, _ in extra), f"run but not priced: {dict(extra)}"
    got_sync: Counter[int] = Counter()
    for (_, axis, m), n in extra.items():
        got_sync[axis] += m * n
    assert got_sync == want_sync, f"gradient sync bytes per axis: ran {dict(got_sync)}, priced {dict(want_sync)}"


def test_recorder_sees_a_missing_collective() -> None:
    """The check can fail: a program that runs one more collective than priced is caught."""
    model, inputs = MODELS["mlp"]()
    cap = capture(model, inputs)
    plan = make_plan(None, (), captured=cap, devices=2, mesh=(2,), mode="mp", objective="comm", baselines=False)
    want, _, _ = priced(cap, plan)
    ran = run_one_step(model, inputs, plan, cap)
    assert Counter(want) - Counter(ran) == Counter()
    assert Counter(want + [("all_gather", 0, 4)]) - Counter(ran) != Counter()
