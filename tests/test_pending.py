"""The loss all-reduce hidden behind backward: a PendingSum waits before any read of its value,
never for metadata or backward, and the lowering makes the output's last all-reduce lazy."""
from __future__ import annotations

import pytest
import torch

from examples.models import mlp
from soybean.capture.core import capture
from soybean.codegen.lower import lower
from soybean.planner.core import plan
from soybean.runtime import context as rt
from soybean.runtime.pending import PendingSum, all_reduce_lazy, wait_all

pytestmark = pytest.mark.unit


class _Work:
    """A started all-reduce: the buffer holds my summand until ``wait`` adds the others'."""

    def __init__(self, buf: torch.Tensor, others: float, log: list) -> None:
        self.buf, self.others, self.log = buf, others, log

    def wait(self) -> None:
        self.log.append("wait")
        self.buf.add_(self.others)


class _AsyncGroup:
    size, index = 2, 0

    def __init__(self, others: float) -> None:
        self.others, self.log = others, []
        self.in_flight: list = []

    def all_reduce_inplace_async(self, t: torch.Tensor) -> _Work:
        return _Work(t, self.others, self.log)


def test_value_reads_wait_metadata_and_backward_do_not() -> None:
    group = _AsyncGroup(others=10.0)
    x = torch.tensor(2.0, requires_grad=True)
    loss = all_reduce_lazy(x * 3, group)
    assert isinstance(loss, PendingSum)
    assert loss.shape == () and loss.dtype == torch.float32 and loss.requires_grad and loss.dim() == 0
    loss.backward()  # the gradient of a sum's summand is the incoming gradient: no value needed
    assert group.log == [] and x.grad == 3.0
    assert float(loss) == 16.0 and group.log == ["wait"]  # 6 + the other member's 10
    assert loss.item() == 16.0 and (loss * 2).item() == 32.0 and group.log == ["wait"]  # waited once
    assert type(loss * 2) is torch.Tensor  # results are plain tensors


def test_every_pending_sum_is_waited_at_the_next_forward() -> None:
    group = _AsyncGroup(others=1.0)
    other = _AsyncGroup(others=5.0)
    loss = all_reduce_lazy(torch.tensor(1.0), group)
    theirs = all_reduce_lazy(torch.tensor(1.0), other)
    assert [id(t) for t in group.in_flight] == [id(loss)] and [id(t) for t in other.in_flight] == [id(theirs)]
    wait_all([group])  # a module waits for its own groups' sums
    assert group.log == ["wait"] and torch.Tensor.item(loss) == 2.0 and not group.in_flight
    assert other.log == [] and len(other.in_flight) == 1  # another module's: still in flight
    wait_all([group, other])
    assert other.log == ["wait"] and torch.Tensor.item(theirs) == 6.0 and not other.in_flight


def test_groups_without_async_sum_at_once() -> None:
    class _Sync:
        size, index = 2, 0

        def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2

    out = all_reduce_lazy(torch.tensor(3.0), _Sync())
    assert not isinstance(out, PendingSum) and out.item() == 6.0


def test_lowering_moves_the_mean_before_a_lazy_loss_all_reduce() -> None:
    model, inputs = mlp(batch=8, hidden=8, layers=1)
    cap = capture(model, inputs)
    p = plan(None, (), 2, mode="dp", captured=cap, baselines=False)
    gm = lower(cap, p, 0)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert calls[-1].target is rt.sb_all_reduce_lazy
    assert calls[-2].target is torch.ops.aten.div.Tensor and calls[-1].args[0] is calls[-2]
    assert not any(n.target is rt.sb_all_reduce for n in calls)
