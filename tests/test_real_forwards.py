"""What real forwards do, captured and trained exactly (issue 21, item 1).

* tensors made in forward from Python values (a sliding window compared with positions, an index list, a
  scalar under a square root) are captured as constants, planned like buffers, and left out of the state dict;
* in-place updates of values forward made (``shifted[:, 1:] = x[:, :-1]``, ``masked_fill_``) train like serial
  under plans that split them;
* a frozen parameter gets no gradient and does not move; a parameter no loss reads (a pooler) gets none either,
  and the gradient sync does not wait for it;
* state-dict hooks: ``full_state_dict`` is ``model.state_dict()`` (a fused ``wqkv`` presented as ``wq``/``wk``/
  ``wv``), and ``load_full_state_dict`` takes what ``model.state_dict()`` gives;
* keyword arguments, in any order, or by position (matched to forward's parameters by name).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.models import llama3
from soybean.api import parallelize
from soybean.capture.core import capture
from soybean.mesh import Mesh
from soybean.planner.core import plan as make_plan
from soybean.runtime.launch import run_threads
from soybean.verify.testing import compare, train_parallel_threads, train_serial

pytestmark = pytest.mark.sim

LR = 1e-4


class MadeInForward(nn.Module):
    """Constants, in-place updates of made values, a frozen table and an unused pooler."""

    def __init__(self, vocab: int = 32, dim: int = 16, seq: int = 9) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim), requires_grad=False)  # frozen, as Whisper's table
        self.proj = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has no gradient: AdamW would move it on noise
        self.out = nn.Linear(dim, vocab)
        self.pooler = nn.Linear(dim, dim)  # feeds an output no loss reads
        self.window = 4

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        b, s = ids.shape
        h = self.emb(ids) + self.pos[:s]
        q, k, v = self.proj(h).chunk(3, dim=-1)
        pos = torch.arange(s)
        near = (pos[None, :] - pos[:, None]).abs() <= torch.tensor(self.window)  # a constant compared
        scores = (q @ k.transpose(1, 2)) / torch.sqrt(torch.tensor(q.shape[-1], dtype=q.dtype))  # a scalar constant
        scores.masked_fill_(~near, -1e4)  # in place on a value forward made
        h = h + scores.softmax(-1) @ v
        shifted = h.new_zeros(h.shape)
        shifted[:, 1:] = h[:, :-1]  # in place through a view
        h = h + shifted + h[:, :, [-2]]  # an index list
        logits = self.out(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits, "pooled": self.pooler(h[:, 0]).tanh()}


def _made(batch: int = 4, seq: int = 9) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MadeInForward(seq=seq)
    return model, {"ids": torch.randint(0, 32, (batch, seq)), "labels": torch.randint(0, 32, (batch, seq))}


@pytest.mark.unit
def test_constants_are_captured_not_refused() -> None:
    model, kwargs = _made()
    cap = capture(model, kwargs)
    assert cap.constants and all(name in cap.buffers for name in cap.constants)
    assert cap.frozen == {"pos"}
    mutating = [n for n in cap.graph.nodes if n.op == "call_function"
                and getattr(getattr(n.target, "_schema", None), "is_mutable", False)]
    assert not mutating, [n.format_node() for n in mutating]  # functionalized


@pytest.mark.parametrize("objective", ["time", "comm"])
def test_made_in_forward_trains_like_serial(objective: str) -> None:
    model, kwargs = _made()
    serial = train_serial(model, kwargs, lr=LR)
    par, plan = train_parallel_threads(model, kwargs, devices=2, objective=objective, lr=LR)
    assert not compare(serial, par), compare(serial, par)[:5]
    assert torch.equal(par.params["pos"], model.pos), "the frozen table moved"
    assert "pos" not in par.grads and "pooler.weight" not in par.grads
    if objective == "comm":
        assert any(t != ["R"] for t in plan.params.values()), "nothing was split"


def test_frozen_parameters_take_no_gradient_and_no_state() -> None:
    model, kwargs = _made()
    plan = make_plan(model, kwargs, devices=2, objective="comm", baselines=False)

    def body(rank: int, groups: list) -> tuple[bool, bool, bool]:
        pm = parallelize(model, kwargs, plan=plan, rank=rank, groups=groups)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)
        pm(**kwargs)["loss"].backward()
        opt.step()
        pos = pm.get_parameter("pos")
        return pos.requires_grad, pos.grad is not None, pos in opt.state

    assert run_threads(Mesh((2,)), body) == [(False, False, False)] * 2


def test_full_state_dict_goes_through_the_models_hooks() -> None:
    """A fused ``wqkv`` is saved as ``wq``/``wk``/``wv`` (the model's own post hook) and loaded back from them (its
    load pre hook); non-persistent buffers (``freqs_cis``) stay out, as in ``model.state_dict()``."""
    model, inputs = llama3(seq=9, vocab=64, dim=32, ffn=64, fused_qkv=True)
    other, _ = llama3(seq=9, vocab=64, dim=32, ffn=64, fused_qkv=True, seed=1)
    want, target = model.state_dict(), other.state_dict()
    assert "layers.0.attention.wq.weight" in want and "layers.0.attention.wqkv.weight" not in want
    plan = make_plan(model, inputs, devices=2, objective="comm", baselines=False)
    assert any(t != ["R"] for t in plan.params.values())

    def body(rank: int, groups: list) -> tuple[bool, bool]:
        pm = parallelize(model, inputs, plan=plan, rank=rank, groups=groups)
        sd = pm.full_state_dict()
        same = sd.keys() == want.keys() and all(torch.equal(sd[k], v) for k, v in want.items())
        pm.load_full_state_dict(target)
        sd2 = pm.full_state_dict()
        return same, all(torch.equal(sd2[k], v) for k, v in target.items())

    assert run_threads(Mesh((2,)), body) == [(True, True)] * 2


def test_keywords_in_any_order_and_a_wrong_call_is_named() -> None:
    model, kwargs = _made()
    plan = make_plan(model, kwargs, devices=2, objective="comm", baselines=False)
    serial = model(**kwargs)["loss"]

    def body(rank: int, groups: list) -> float:
        pm = parallelize(model, kwargs, plan=plan, rank=rank, groups=groups)
        loss = pm(labels=kwargs["labels"], ids=kwargs["ids"])["loss"]  # the other order
        again = pm(kwargs["ids"], kwargs["labels"])["loss"]  # by position: matched to forward's parameters by name
        assert torch.equal(loss, again)
        with pytest.raises(TypeError, match="captured with keyword arguments"):
            pm(ids=kwargs["ids"])
        return float(loss)

    assert run_threads(Mesh((2,)), body) == pytest.approx([float(serial)] * 2, rel=1e-5)


def test_sliding_window_mask_of_constants_folds() -> None:
    """A mask built from a window constant and positions is evaluated at capture (``fold_constant_masks`` reads the
    constants' values): a window as long as the sequence is the causal mask."""

    class Windowed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = x.shape[1]
            pos = torch.arange(s)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < torch.tensor(s))  # causal: every earlier position is in the window
            q = self.proj(x).view(x.shape[0], s, 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    cap = capture(Windowed(), (torch.randn(2, 5, 8),))
    (sdpa,) = [n for n in cap.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa.args[3] is None and sdpa.args[5] is True and not cap.constants
    assert math.isfinite(float(cap.graph_module(*[p for _, p in Windowed().named_parameters()],
                                                 torch.randn(2, 5, 8))[0]))


class Branches(nn.Module):
    """Two independent branches of one shape, computed in an order a flag sets: what Python's ``set`` iteration
    does to a forward in two processes (ModernBERT's rotary tables per layer type)."""

    def __init__(self, swap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 12), nn.Linear(8, 12)
        self.out = nn.Linear(24, 4)
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        names = ("b", "a") if self.swap else ("a", "b")
        # a batch-split branch's sum over the batch is a pending sum, made whole before exp: one all-reduce each
        made = {n: getattr(self, n)(x).tanh().sum(0).exp() for n in names}
        return self.out(torch.cat([made["a"], made["b"]], dim=-1)).pow(2).mean()


def test_ranks_whose_captures_order_independent_ops_differently_run_one_program() -> None:
    """A plan made on one order runs on a capture in the other (names matched by structural key, ops lowered in the
    plan's order): every rank issues its collectives in one order (each branch's all-reduce), and training equals
    serial.  Lowered in each rank's own order, rank 0 would sum its ``a`` with rank 1's ``b``."""
    x = torch.randn(6, 8)
    first, second = capture(Branches(False), (x,)), capture(Branches(True), (x,))
    assert first.fingerprint == second.fingerprint and first.keys != second.keys  # same structure, other names
    plan = make_plan(None, (), devices=2, captured=first, mode="dp", baselines=False)
    assert plan.inputs["x"] == ["S(0)"]
    serial = train_serial(Branches(False), (x,), lr=LR)
    models = [Branches(False), Branches(True)]  # built here: the global random state is no thread's own

    def body(rank: int, groups: list) -> list[float]:
        pm = parallelize(models[rank], (x,), plan=plan, rank=rank, groups=groups, captured=second if rank else first)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)
        losses = []
        for _ in range(3):
            loss = pm(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses

    for losses in run_threads(Mesh((2,)), body):
        assert losses == pytest.approx(serial.losses, rel=1e-5)
