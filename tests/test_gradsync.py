"""GradSync, the bucketed gradient sum, on the thread tier: the sum is exact step after step,
a parameter listed twice (a tied weight behind two placeholders) is summed once, and a backward
that leaves a parameter without a gradient is reported instead of silently leaving the others
unsummed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from soybean.mesh import Mesh
from soybean.runtime import run_threads
from soybean.runtime.gradsync import GradSync

pytestmark = pytest.mark.sim


def _params(rank: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)  # not the global RNG: the ranks are threads drawing at once
    return [nn.Parameter(torch.randn(3, 2, dtype=torch.float64, generator=gen)), nn.Parameter(torch.randn(4, dtype=torch.float64, generator=gen))]


def _loss(ps: list[nn.Parameter], rank: int, step: int) -> torch.Tensor:
    # A different summand of the gradient on every rank and every step.
    c = float(rank + 1 + 10 * step)
    return c * (ps[0] ** 2).sum() + (c + 1) * ps[1].sum()


@pytest.mark.parametrize("listed_twice", [False, True])
def test_sum_over_ranks_every_step(listed_twice: bool) -> None:
    world = 2

    def member(rank: int, groups: list) -> list[list[torch.Tensor]]:
        ps = _params(rank)
        listing = [(p, (0,)) for p in ps] + ([(ps[0], (0,))] if listed_twice else [])
        sync = GradSync(listing, groups, bucket_mb=1e-5, first_bucket_mb=1e-5)  # one parameter per bucket
        out = []
        for step in range(3):
            for p in ps:
                p.grad = None
            _loss(ps, rank, step).backward()
            sync.check_complete()
            out.append([p.grad.clone() for p in ps])
        return out

    res = run_threads(Mesh((world,)), member, timeout_s=30)
    ps = _params(0)
    for step in range(3):
        want = [torch.zeros_like(p) for p in ps]
        for rank in range(world):
            qs = [p.detach().clone().requires_grad_() for p in ps]
            _loss(qs, rank, step).backward()
            want = [w + q.grad for w, q in zip(want, qs)]
        for rank in range(world):
            for got, w in zip(res[rank][step], want):
                torch.testing.assert_close(got, w)


def test_incomplete_backward_is_reported() -> None:
    def member(rank: int, groups: list) -> str:
        ps = _params(rank)
        sync = GradSync([(p, (0,)) for p in ps], groups, bucket_mb=1e-5, first_bucket_mb=1e-5)
        (ps[1] * 2).sum().backward()  # ps[0] takes no part: its bucket never completes
        with pytest.raises(RuntimeError, match="did not reach every parameter"):
            sync.check_complete()
        return "ok"

    assert run_threads(Mesh((2,)), member, timeout_s=30) == ["ok", "ok"]


def test_buckets_close_as_ddp_closes_them() -> None:
    """A bucket closes once it reaches its cap, with the gradient that crossed it (DDP's rule): the last
    layer's weight shares the first, small bucket with its bias instead of waiting for the end of backward."""
    mib = 2**18  # float32 elements in 1 MiB
    sizes = [mib, 512, mib, 512, mib, 512]  # (weight, bias) x 3 layers, in registration order
    ps = [nn.Parameter(torch.zeros(n)) for n in sizes]
    groups = run_threads(Mesh((1,)), lambda rank, groups: groups)[0]
    sync = GradSync([(p, (0,)) for p in ps], groups, bucket_mb=1.0, first_bucket_mb=1.0)
    assert [[sizes[[id(q) for q in ps].index(id(p))] for p in b] for b in sync.buckets] == \
        [[512, mib], [512, mib], [512, mib]]
    for h in sync.handles:
        h.remove()


@pytest.mark.parametrize("deferred", ["none", "middle", "first-two"])
@pytest.mark.parametrize("mesh,mode", [((2,), "dp"), ((4,), "dp"), ((2, 2), "auto")])
def test_gradient_accumulation_over_backward_passes_is_serial(mesh, mode, deferred) -> None:
    """Three backward passes (two batches, one of them twice) without ``zero_grad`` between them, as a loop that
    accumulates gradients runs: each parameter's gradient is the serial accumulated one, not an earlier pass's sum
    counted once more per rank (``GradSync``: the earlier gradient set aside while this one is summed).  A
    parameter summed by ``GradSync`` is checked to exist (the data-parallel plans sum every weight so).  Some passes
    may defer their sum, as DDP's ``no_sync`` does (``soybean.hf``'s): the middle one (a sum, an unsummed pass, a sum)
    or the first two (summed by the last pass), each exact."""
    from examples.models import mlp
    from soybean.api import parallelize
    from soybean.capture.core import capture
    from soybean.planner.core import plan as make_plan
    from soybean.verify.testing import _gather_grads

    model, (x, y) = mlp(batch=10, hidden=8, layers=1)
    model, x, y = model.double(), x.double(), y.double()
    x2, y2 = torch.randn_like(x), torch.randn_like(y)
    batches = [(x, y), (x2, y2), (x, y)]
    model.zero_grad()
    for a, b in batches:
        torch.nn.functional.mse_loss(model(a), b).backward()
    serial = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    cap = capture(model, (x,))
    p = make_plan(None, (), Mesh(mesh).size, mesh=mesh, mode=mode, objective="comm", baselines=False, captured=cap)

    def body(rank: int, groups: list):
        pm = parallelize(model, (x,), plan=p, rank=rank, groups=groups, captured=cap)
        assert pm._grad_sync is not None
        skip = {"none": (), "middle": (1,), "first-two": (0, 1)}[deferred]
        for i, (a, b) in enumerate(batches):
            pm._grad_sync.deferred = i in skip
            torch.nn.functional.mse_loss(pm(a), b).backward()
        return _gather_grads(pm)

    for grads in run_threads(Mesh(mesh), body):
        for k, g in serial.items():
            assert torch.allclose(grads[k], g, rtol=1e-12, atol=1e-14), k
