"""Outputs as training loops meet them (``soybean.run.outputs``): the loss computed outside the model.

Full-batch contract: a split output comes back as a ``LazyFull``; a ``torch.nn.functional`` loss on it moves only
the scalar, and any other use gathers it once; training equals serial either way.  Local-batch contract (DDP's):
each rank's loss on its tile is a mean over its slice, and the gradients are DDP's average, equal to serial.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.models import mlp
from soybean.api import parallelize
from soybean.capture.core import capture
from soybean.mesh import Mesh
from soybean.run.outputs import LazyFull
from soybean.planner.core import plan as make_plan
from soybean.runtime.launch import run_threads
from soybean.verify.testing import _gather_grads

pytestmark = pytest.mark.sim

MESHES = [(1,), (2,), (4,), (2, 2)]


def _serial(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, **kw) -> tuple[float, dict]:
    model.zero_grad()
    loss = loss_fn(model(x), y, **kw)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return float(loss.detach()), grads


def _gathers(monkeypatch) -> list[bool]:
    """Records every ``LazyFull.full`` call (True: it gathered, False: it reused the gathered tensor)."""
    import soybean.run.outputs as outputs

    calls: list[bool] = []
    real = outputs.LazyFull.full

    def counting(self):
        calls.append(self._full is None)
        return real(self)

    monkeypatch.setattr(outputs.LazyFull, "full", counting)
    return calls


def _run(model, x, y, mesh, loss_fn, local_batch=False, mode="dp", counter=None, **kw):
    cap = capture(model, (x,))
    p = make_plan(None, (), Mesh(mesh).size, mesh=mesh, mode=mode, baselines=False, captured=cap,
                  local_batch=local_batch)

    def body(rank: int, groups: list):
        pm = parallelize(model, (x,), plan=p, rank=rank, groups=groups, captured=cap)
        xi, yi = (pm.local_slice(x), pm.local_slice(y)) if local_batch else (x, y)
        out = pm(xi)
        if counter is not None:
            counter(out)
        loss = loss_fn(out, yi, **kw)
        loss.backward()
        return float(loss.detach()), _gather_grads(pm), type(out)

    return p, run_threads(Mesh(mesh), body)


def _close(grads: dict, serial: dict) -> None:
    for k, g in serial.items():
        assert torch.allclose(grads[k], g, rtol=1e-9, atol=1e-12), k


CASES = [  # (loss, kwargs, classification)
    (F.mse_loss, {}, False), (F.mse_loss, {"reduction": "sum"}, False), (F.l1_loss, {}, False),
    (F.smooth_l1_loss, {"beta": 0.5}, False), (F.cross_entropy, {}, True),
    (F.cross_entropy, {"ignore_index": 1, "label_smoothing": 0.1}, True),
    (F.cross_entropy, {"weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0], dtype=torch.float64)}, True),
    (F.binary_cross_entropy_with_logits, {}, False),
]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("loss_fn,kw,cls", CASES, ids=lambda c: getattr(c, "__name__", None) or str(c))
def test_loss_outside_reduces_only_the_scalar_and_equals_serial(mesh, loss_fn, kw, cls, monkeypatch) -> None:
    """Batch 10 (uneven over 4): every loss of the table, on its tile, sums to the serial loss and gradients,
    without gathering the output."""
    calls = _gathers(monkeypatch)
    model, (x, y) = mlp(batch=10, hidden=8, layers=1, classes=5 if cls else None)
    model, x = model.double(), x.double()
    y = y if cls else y.double()
    if loss_fn is F.binary_cross_entropy_with_logits:
        y = torch.rand_like(y)  # probabilities
    want, grads = _serial(model, x, y, loss_fn, **kw)
    p, ranks = _run(model, x, y, mesh, loss_fn, **kw)
    for loss, got, kind in ranks:
        assert loss == pytest.approx(want, rel=1e-12)
        _close(got, grads)
        assert kind is (LazyFull if Mesh(mesh).size > 1 else torch.Tensor)
    assert calls == []


REDUCTIONS = [  # a loop's whole-output reductions, each on the tiles: (name, fn)
    ("sum", lambda o, y: o.sum()), ("float-sum", lambda o, y: o.float().sum()), ("mean", lambda o, y: o.mean()),
    ("torch.sum", lambda o, y: torch.sum(o)), ("torch.mean", lambda o, y: torch.mean(o)),
    ("to-double-mean", lambda o, y: o.to(torch.float64).mean()), ("sum-dtype", lambda o, y: o.sum(dtype=torch.float64)),
]


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("name,fn", REDUCTIONS, ids=[n for n, _ in REDUCTIONS])
def test_a_whole_sum_or_mean_of_a_split_output_moves_one_scalar(mesh, name, fn, monkeypatch) -> None:
    """``out.sum()``, ``out.mean()`` and a cast before them (what a loop or a benchmark does with a model that
    returns logits) are the tiles' sums all-reduced: serial value and gradients, no gather.  Batch 10: uneven
    over 4; the 2x2 mesh splits the batch over both axes under ``dp``."""
    calls = _gathers(monkeypatch)
    model, (x, y) = mlp(batch=10, hidden=8, layers=1)
    model, x, y = model.double(), x.double(), y.double()
    want, grads = _serial(model, x, y, fn)
    _, ranks = _run(model, x, y, mesh, fn)
    for loss, got, kind in ranks:
        assert kind is LazyFull
        assert loss == pytest.approx(want, rel=1e-6 if name == "float-sum" else 1e-12)  # float32 sums round
        _close(got, grads)
    assert calls == []
    # with a dim it is the full tensor's reduction: gathered, and still serial
    calls.clear()
    want, grads = _serial(model, x, y, lambda o, t: o.sum(0).pow(2).sum())
    _, ranks = _run(model, x, y, mesh, lambda o, t: o.sum(0).pow(2).sum())
    assert all(loss == pytest.approx(want, rel=1e-12) for loss, _, _ in ranks) and calls.count(True) == len(ranks)


def test_a_loss_on_the_tile_gathers_nothing_but_any_other_use_gathers_once(monkeypatch) -> None:
    """The fast path sends one scalar per split axis; ``.argmax``, indexing and arithmetic gather once."""
    calls = _gathers(monkeypatch)
    model, (x, y) = mlp(batch=8, hidden=8, layers=1, classes=4)
    _run(model, x, y, (2,), F.cross_entropy)
    assert calls == []  # the loss needed no gather

    def uses(out: LazyFull) -> None:
        assert out.shape == (8, 4) and out.dim() == 2 and out.size(0) == 8 and len(out) == 8 and out.numel() == 32
        assert out._full is None  # metadata only: nothing gathered (per output: the ranks run as threads)
        full = out.full()
        assert torch.equal(out.argmax(-1), full.argmax(-1)) and torch.equal(out[3], full[3])
        assert torch.equal(out * 2, full * 2) and torch.allclose(torch.softmax(out, -1), torch.softmax(full, -1))

    _, ranks = _run(model, x, y, (2,), lambda o, t: F.cross_entropy(o.full(), t), counter=uses)
    assert calls.count(True) == 2  # one gather per rank, later reads reuse it
    want, grads = _serial(model, x, y, F.cross_entropy)
    for loss, got, _ in ranks:
        assert loss == pytest.approx(want, rel=1e-6)


def test_a_loss_the_fast_path_does_not_cover_gathers_and_still_equals_serial() -> None:
    """A broadcast target and a hand-written loss go through the whole output."""
    model, (x, y) = mlp(batch=6, hidden=8, layers=1)
    model, x, y = model.double(), x.double(), y.double()

    def hand(out, t):
        return ((out - t) ** 2).mean() + out.abs().sum() * 1e-3

    want, grads = _serial(model, x, y, hand)
    for loss, got, _ in _run(model, x, y, (2, 2), hand)[1]:
        assert loss == pytest.approx(want, rel=1e-12)
        _close(got, grads)


@pytest.mark.parametrize("mesh,mode", [((2,), "dp"), ((4,), "dp"), ((2, 2), "dp")])
def test_local_batch_loss_outside_trains_as_ddp(mesh, mode) -> None:
    """Each rank's loss is the mean over its own slice; the gradients are DDP's average, the serial ones."""
    model, (x, y) = mlp(batch=8, hidden=8, layers=1)
    model, x, y = model.double(), x.double(), y.double()
    _, grads = _serial(model, x, y, F.mse_loss)
    p, ranks = _run(model, x, y, mesh, F.mse_loss, local_batch=True, mode=mode)
    assert all(t == ["S(0)"] * len(mesh) for t in p.inputs.values())
    for _, got, kind in ranks:
        assert kind is torch.Tensor
        _close(got, grads)


def test_full_outputs_are_still_available() -> None:
    model, (x, y) = mlp(batch=4, hidden=8, layers=1)
    cap = capture(model, (x,))
    p = make_plan(None, (), 2, mesh=(2,), mode="dp", baselines=False, captured=cap)

    def body(rank: int, groups: list):
        out = parallelize(model, (x,), plan=p, rank=rank, groups=groups, captured=cap, outputs="full")(x)
        return type(out), torch.allclose(out, model(x))

    assert run_threads(Mesh((2,)), body) == [(torch.Tensor, True)] * 2
    with pytest.raises(ValueError, match="unknown outputs"):
        parallelize(model, (x,), plan=p, rank=0, groups=[None], captured=cap, outputs="gathered")


class _Logits(torch.nn.Module):
    """A language-model head in miniature: a hidden layer and a wide vocabulary, returning the logits (as a
    Hugging Face model does; the loop computes the loss)."""

    def __init__(self, hidden: int = 16, vocab: int = 256) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.up(x)))


@pytest.mark.parametrize("mesh", [(8,), (2, 4)], ids=lambda m: "x".join(map(str, m)))
def test_the_planner_leaves_logits_split_where_the_gather_costs_more(mesh) -> None:
    """A 32,000-word head at batch 4,096 on 8 modelled H100s (meta device): under ``outputs="lazy"`` (the default)
    the plan leaves the logits split along dim 0 (``nodes["output"]``), as ``LazyFull`` hands them to the loop, and
    is modelled faster than the same search under ``outputs="full"``, which prices their gather and records none."""
    with torch.device("meta"):
        model, x = _Logits(1024, 32000), torch.randn(4096, 1024)
    cap = capture(model, (x,))
    lazy = make_plan(None, (), 8, mesh=mesh, baselines=False, captured=cap, profile="h100-nvlink")
    full = make_plan(None, (), 8, mesh=mesh, baselines=False, captured=cap, profile="h100-nvlink", outputs="full")
    assert (lazy.outputs, full.outputs) == ("lazy", "full") and "output" not in full.nodes
    tiling = lazy.nodes["output"]["in"][0]
    assert set(tiling) <= {"R", "S(0)"} and "S(0)" in tiling
    assert lazy.cost["step_time_s"] < full.cost["step_time_s"]


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_logits_left_split_are_priced_as_the_lazy_read_and_train_as_serial(mesh) -> None:
    """The lazy plan (data parallel forced, so the small logits split) records the output's tiling and is modelled
    cheaper than the same layout priced with the gather; run, the output is the planned tile, the loss of the tiles
    is the serial loss and the gradients are serial; the same plan run with ``outputs="full"`` gathers in the
    program and returns the serial logits.  Batch 10: uneven over 4."""
    from soybean.report.explain import explain

    torch.manual_seed(0)
    model = _Logits().double()
    x, y = torch.randn(10, 16, dtype=torch.float64), torch.randint(0, 256, (10,))
    cap = capture(model, (x,))
    n = Mesh(mesh).size
    lazy = make_plan(None, (), n, mesh=mesh, mode="dp", baselines=False, captured=cap)
    full = make_plan(None, (), n, mesh=mesh, mode="dp", baselines=False, captured=cap, outputs="full")
    tiling = lazy.nodes["output"]["in"][0]
    assert tiling == ["S(0)"] * len(mesh) and "output" not in full.nodes
    assert lazy.cost["step_time_s"] < full.cost["step_time_s"]
    explain(cap, lazy)  # the table rebuilt from the plan holds the plan's own output choice
    want, grads = _serial(model, x, y, F.cross_entropy)

    def body(rank: int, groups: list):
        pm = parallelize(model, (x,), plan=lazy, rank=rank, groups=groups, captured=cap)
        out = pm(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        whole = parallelize(model, (x,), plan=lazy, rank=rank, groups=groups, captured=cap, outputs="full")(x)
        return float(loss.detach()), _gather_grads(pm), out, whole

    for loss, got, out, whole in run_threads(Mesh(mesh), body):
        assert isinstance(out, LazyFull) and [str(p) for p in out.tiling] == tiling
        assert loss == pytest.approx(want, rel=1e-12)
        _close(got, grads)
        assert type(whole) is torch.Tensor and torch.allclose(whole, model(x), rtol=1e-12)


def test_the_outputs_option_is_checked_and_on_the_command_line() -> None:
    from soybean.options import PlanOptions, default

    assert default("outputs") == "lazy" and PlanOptions(outputs="full").outputs == "full"
    with pytest.raises(ValueError, match="unknown outputs 'whole': use one of lazy, full"):
        PlanOptions(outputs="whole")


class _TinyLM(torch.nn.Module):
    """Token ids in, logits ``(batch, seq, vocab)`` out, as a causal language model returns them."""

    def __init__(self, vocab: int = 32, hidden: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _hf_loss(logits, labels):
    """transformers' own causal-LM loss: ``float()``, labels shifted, ``view(-1, vocab)``, cross-entropy."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=32)


def _shift_loss(logits, labels):
    """The classic loop's shift: ``logits[..., :-1, :].contiguous()`` against ``labels[..., 1:]``."""
    shift = logits[..., :-1, :].contiguous()
    return F.cross_entropy(shift.view(-1, shift.size(-1)), labels[..., 1:].contiguous().view(-1), ignore_index=-100)


def _flat_sum_loss(logits, labels):
    """A sum loss over ``flatten(0, 1)`` logits with some labels ignored."""
    return F.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("loss_fn", [_hf_loss, _shift_loss, _flat_sum_loss], ids=lambda f: f.__name__)
def test_a_language_models_loss_on_split_logits_gathers_nothing(mesh, loss_fn, monkeypatch) -> None:
    """The losses loops compute from ``(batch, seq, vocab)`` logits (transformers' ``ForCausalLMLoss``, the shift
    and flatten of older loops) run on the tiles: the views stay lazy, no gather, serial loss and gradients.
    Batch 7: uneven over 2 and 4; some labels ignored."""
    pytest.importorskip("transformers")
    calls = _gathers(monkeypatch)
    torch.manual_seed(0)
    model = _TinyLM().double()
    ids = torch.randint(0, 32, (7, 6))
    labels = torch.randint(0, 32, (7, 6))
    labels[1, 2] = labels[6, 0] = -100
    want, grads = _serial(model, ids, labels, loss_fn)
    p, ranks = _run(model, ids, labels, mesh, loss_fn)
    assert p.nodes["output"]["in"][0] == ["S(0)"] * len(mesh)
    rel = 1e-6 if loss_fn is _hf_loss else 1e-12  # transformers' loss upcasts to float32: its sums round there
    for loss, got, kind in ranks:
        assert kind is LazyFull
        assert loss == pytest.approx(want, rel=rel)
        for k, g in grads.items():
            assert torch.allclose(got[k], g, rtol=rel * 10, atol=1e-12 if rel < 1e-9 else 1e-7), k
    assert calls == []


def test_lazy_views_match_the_full_tensor() -> None:
    """Each lazy view's tile is the matching rows of the full tensor's view, and gathering it gives that view:
    ``view(-1, v)``, ``flatten(0, 1)``, ``[..., :-1, :]``, ``[:, 0]``; other views gather (``view(b, -1)``)."""
    torch.manual_seed(0)
    model = _TinyLM().double()
    ids = torch.randint(0, 32, (5, 6))
    full = model(ids)
    cap = capture(model, (ids,))
    p = make_plan(None, (), 2, mesh=(2,), mode="dp", baselines=False, captured=cap)

    def body(rank: int, groups: list):
        out = parallelize(model, (ids,), plan=p, rank=rank, groups=groups, captured=cap)(ids)
        views = {"view": out.view(-1, 32), "flatten": out.flatten(0, 1), "shift": out[..., :-1, :].contiguous(),
                 "first": out[:, 0], "reshape": out.float().reshape(30, 32)}
        return {k: (type(v), v.full().detach()) for k, v in views.items()}, out.view(5, -1).detach()

    for views, other in run_threads(Mesh((2,)), body):
        wants = {"view": full.view(-1, 32), "flatten": full.flatten(0, 1), "shift": full[..., :-1, :],
                 "first": full[:, 0], "reshape": full.float().reshape(30, 32)}
        for k, (kind, got) in views.items():
            assert kind is LazyFull and torch.allclose(got, wants[k].detach(), rtol=1e-6), k
        assert torch.allclose(other, full.view(5, -1).detach(), rtol=1e-12)


class _SplitVocabHead(torch.nn.Module):
    """MobileBERT's masked-LM head in small (``h @ cat([decoder.weight.t(), dense.weight]) + bias``): under ``comm`` on
    2 devices the plan leaves its logits split along the vocabulary, their last dim."""

    def __init__(self, vocab: int = 128, hidden: int = 64, embed: int = 32) -> None:
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, hidden)
        self.dense = torch.nn.Linear(vocab, hidden - embed, bias=False)
        self.decoder = torch.nn.Linear(embed, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(self.emb(ids)))
        return h.matmul(torch.cat([self.decoder.weight.t(), self.dense.weight], dim=0)) + self.decoder.bias


def test_views_of_an_output_split_along_another_dim_are_the_full_tensors() -> None:
    """An output split along its last dim (not the batch): ``reshape(-1, vocab)`` and ``[..., :100]`` are the full
    tensor's (they took the tile for rows and failed in the gather: MobileBERT under ``comm``), and a loop's loss
    through them trains as serial, gradients included."""
    torch.manual_seed(0)
    model = _SplitVocabHead().double()
    ids = torch.randint(0, 128, (4, 16))
    cap = capture(model, (ids,))
    p = make_plan(None, (), 2, objective="comm", baselines=False, captured=cap)

    def loss_of(out):
        return F.cross_entropy(out.reshape(-1, 128), ids.reshape(-1)) + out[..., :100].float().pow(2).mean()

    want, grads = _serial(model, ids, None, lambda out, _: loss_of(out))

    def body(rank: int, groups: list):
        pm = parallelize(model, (ids,), plan=p, rank=rank, groups=groups, captured=cap)
        out = pm(ids)
        tiling = out.tiling
        loss = loss_of(out)
        loss.backward()
        return tiling, float(loss.detach()), _gather_grads(pm)

    for tiling, got, g in run_threads(Mesh(tuple(p.mesh)), body):
        assert any(getattr(t, "dim", 0) == 2 for t in tiling), tiling  # the case: split along the vocabulary
        assert got == pytest.approx(want, rel=1e-12)
        _close(g, grads)
