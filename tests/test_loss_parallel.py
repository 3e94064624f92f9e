"""Cross-entropy with its classes split (loss parallelism, ``rules.loss`` / ``runtime.vocab_loss``).

The rule itself is checked against the serial op on 2, 3 (uneven classes) and 2x2 members with every other rule
(``tests/test_rules.py``).  Here: the synchronised call on 1-4 members is the serial loss and gradient in float64
and gathers, member by member, the bytes ``cross_entropy_comm`` prices; the planner keeps a large vocabulary's
logits split from the output projection through the loss, says so in ``explain``'s steps, and the plan trains as
serial, in threads and on 2 gloo processes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from soybean.mesh import Mesh
from soybean.rules.base import expand, make_opspec
from soybean.runtime.launch import run_threads
from soybean.verify.testing import train_parallel_threads, train_serial
from soybean.tiling import R, Shard, chunk_range

aten = torch.ops.aten


class _Gathers:
    """A group that logs the bytes of each all-gather's whole result (as ``cost.collectives`` prices a gather) and
    delegates it."""

    def __init__(self, inner: object, log: list[tuple[str, float]]) -> None:
        self.inner, self.log = inner, log
        self.size, self.index = inner.size, inner.index  # type: ignore[attr-defined]

    def all_gather(self, t: torch.Tensor, dim: int, full: int) -> torch.Tensor:
        out = self.inner.all_gather(t, dim, full)  # type: ignore[attr-defined]
        self.log.append(("all_gather", float(out.numel() * out.element_size())))
        return out


@pytest.mark.unit
@pytest.mark.parametrize("parts,reduction", [(1, 1), (2, 2), (3, 1), (4, 0), (4, 1)])
def test_class_split_cross_entropy_is_the_serial_loss_and_gathers_the_bytes_priced(parts: int, reduction: int) -> None:
    """11 classes over ``parts`` members (uneven), 7 rows with an ignored one and class weights: every member's loss
    and its logits' gradient tile are the serial op's (float64), and the all-gathers it runs carry the bytes the
    rule prices, forward only."""
    from soybean.rules.loss import cross_entropy_comm
    from soybean.runtime.context import use_groups
    from soybean.runtime.vocab_loss import sb_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([3, 10, 0, -100, 5, 7, 3])
    w = torch.rand(11, dtype=torch.float64) + 0.5
    want = F.cross_entropy(x, y, weight=w, reduction=("none", "mean", "sum")[reduction])
    cot = torch.randn_like(want)
    (want_grad,) = torch.autograd.grad(want, x, cot)
    op = make_opspec(aten.cross_entropy_loss.default, (x, y, w, reduction), {}, want)
    mesh = Mesh((parts,))
    st = next(s for s in expand(op, mesh) if s.inputs[0] == (Shard(1),))
    assert st.inputs[1] == (R,) and st.outputs[0] == (R,)
    priced = [(c.kind, c.bytes) for c in cross_entropy_comm(op, st, [True, False, False], mesh)]
    logs: list[list[tuple[str, float]]] = [[] for _ in range(parts)]
    got: list = [None] * parts

    def member(rank: int, groups: list) -> None:
        a, b = chunk_range(11, parts, rank)
        mine = x[:, a:b].detach().requires_grad_(True)
        with use_groups([_Gathers(groups[0], logs[rank])]):
            loss = sb_cross_entropy(mine, y, w, reduction, class_axes=(0,), classes=11)
            loss.backward(cot)
        got[rank] = (loss.detach(), mine.grad)

    run_threads(mesh, member)
    assert all(log == priced for log in logs) and len(priced) == (parts > 1)
    for loss, _ in got:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(torch.cat([g for _, g in got], 1), want_grad, rtol=1e-13, atol=1e-14)


# A causal Llama whose output projection and loss are most of its work (a 32,000-word vocabulary over hidden 64):
# on 2 ``cpu-gloo`` devices the planner splits the vocabulary (torchtitan's loss parallelism).
_VOCAB = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=32000, batch=4, seq=64)


def _loss_split(p: object) -> list[str]:
    return [n for n, d in p.nodes.items() if n.startswith("cross_entropy") and d["in"][0] == ["S(1)"]]  # type: ignore


@pytest.mark.sim
def test_the_planner_keeps_a_large_vocabulary_split_through_the_loss() -> None:
    """The Llama above on 2 devices (the default ``time`` objective): the loss reads its logits split by class,
    ``explain`` names the statistics it gathers, and three AdamW steps with every rank a thread equal serial
    training (judged against the float64 run)."""
    pytest.importorskip("transformers")
    from soybean.capture.core import capture
    from soybean.report.explain import explain
    from soybean.models import load
    from soybean.planner.core import plan
    from soybean.verify.sweep import differences, exact_serial

    model, inputs = load("hf:llama", _VOCAB)
    cap = capture(model, inputs)
    p = plan(None, (), captured=cap, devices=2, baselines=False)
    assert _loss_split(p) == ["cross_entropy_loss_default"]
    assert ("class_statistics[axis 0]", "forward") in {(c.step, c.phase) for r in explain(cap, p).rows
                                                       for c in r.collectives}
    serial = train_serial(model, inputs, steps=3, lr=1e-4)
    par, _ = train_parallel_threads(model, inputs, plan=p, steps=3, lr=1e-4)
    assert not differences(serial, exact_serial(model, inputs, serial, lr=1e-4), par, lr=1e-4)


def _vocab_rank(rank: int, world: int) -> tuple:
    """One gloo rank: the Llama above parallelized on ``world`` processes and trained; its trace and split losses."""
    import soybean
    from soybean.models import load
    from soybean.verify.testing import train_parallel

    torch.set_num_threads(1)
    model, inputs = load("hf:llama", _VOCAB)
    pm = soybean.parallelize(model, inputs, devices=world)
    return train_parallel(pm, model, inputs, 3, 1e-4), _loss_split(pm.plan)


@pytest.mark.dist
def test_a_vocabulary_split_through_the_loss_trains_as_serial_on_gloo() -> None:
    """The same on 2 gloo processes: the loss split by class, three AdamW steps equal serial training."""
    pytest.importorskip("transformers")
    from soybean.models import load
    from soybean.runtime.launch import spawn
    from soybean.verify.sweep import differences, exact_serial

    par, split = spawn(_vocab_rank, 2, timeout_s=600)[0]
    assert split == ["cross_entropy_loss_default"]
    model, inputs = load("hf:llama", _VOCAB)
    serial = train_serial(model, inputs, steps=3, lr=1e-4)
    assert not differences(serial, exact_serial(model, inputs, serial, lr=1e-4), par, lr=1e-4)
