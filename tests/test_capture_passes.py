"""Capture's rewrites are the named, ordered list ``capture.passes.PASSES``, and each pass is observable.

A toy model carries one construct per pass: an empty tensor made in forward (which ``torch.export``
lifts into a constant), a ``torch.no_grad()`` block (which it wraps in a higher-order op), a
``.to(dtype)`` (which it guards with ``_assert_tensor_metadata``), an in-place update of a slice of a
value forward made, a constant causal attention mask, the three mean losses (``mean``,
``mse_loss``, ``cross_entropy``) and routed experts as transformers computes them (rows sorted by expert, a grouped
matmul, weighted and summed back per token).  The full pipeline removes every construct and keeps the loss's value; leaving
out any one pass leaves exactly that pass's construct in the graph.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import soybean.capture.passes as capmod
from soybean.capture.core import Captured, capture
from soybean.capture.passes import PASSES, Pass
from soybean.capture.passes.functionalize import functional_variant

transformers_moe = pytest.importorskip("transformers.integrations.moe")  # its grouped matmul (the experts' op)

pytestmark = pytest.mark.unit

aten = torch.ops.aten
BATCH, SEQ, HIDDEN, EXPERTS = 2, 5, 8, 3


class Toy(nn.Module):
    """A linear layer, a (1, HIDDEN) bias squeezed, causal self-attention with an explicit mask, routed experts and a
    sum of three mean losses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN)
        self.bias = nn.Parameter(torch.full((1, HIDDEN), 0.1))  # squeezed where it is read, as ERNIE 4.5's router

    def routed(self, h: torch.Tensor) -> torch.Tensor:
        """Top-2 routed experts, transformers' dataflow (``integrations.moe.grouped_mm_experts_forward``)."""
        w, idx = torch.topk(self.router(h).softmax(-1), 2)
        ids, perm = torch.sort(idx.reshape(-1))
        rows = h[perm // 2]
        offs = torch.cumsum(torch.histc(ids.to(torch.float32), bins=EXPERTS, min=0, max=EXPERTS - 1), 0,
                            dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(rows, self.experts, offs) * w.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm).index_put((perm,), torch.arange(perm.shape[0], device=h.device))
        return out[inv].view(h.shape[0], 2, HIDDEN).sum(1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a grad-mode region
            pos = torch.arange(SEQ, device=x.device).to(x.dtype) / SEQ
        h = self.lin(x.to(torch.float32)) + pos[:, None] + self.bias.squeeze()  # .to(dtype): an assertion
        h = torch.cat([h.reshape(-1), torch.tensor([], device=x.device)]).view_as(h)  # an empty constant
        shifted = h.new_zeros(h.shape)
        shifted[:, 1:] = h[:, :-1]  # an in-place update through a view of a value forward made
        h = h + shifted
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device=x.device).tril()  # constant and causal
        q = h.view(BATCH, SEQ, 2, HIDDEN // 2).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).reshape(BATCH, SEQ, HIDDEN)
        a = a + self.routed(a.reshape(-1, HIDDEN)).view(BATCH, SEQ, HIDDEN)
        return F.mse_loss(a, y) + a.mean(-1).mean() + F.cross_entropy(a.reshape(-1, HIDDEN), labels)


def toy() -> tuple[Toy, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    labels = torch.randint(0, HIDDEN, (BATCH * SEQ,), generator=gen)
    labels[3] = -100  # an ignored label: the cross-entropy count must skip it
    return Toy(), (x, y, labels)


@functools.cache
def captured(without: str | None = None) -> Captured:
    """The toy captured with every pass but ``without``."""
    model, inputs = toy()
    return capture(model, inputs, passes=tuple(p for p in PASSES if p.name != without))


def calls(g: fx.Graph, target: object) -> list[fx.Node]:
    return [n for n in g.nodes if n.op == "call_function" and n.target == target]


def _reduction(n: fx.Node, position: int) -> object:
    return n.args[position] if len(n.args) > position else n.kwargs.get("reduction", 1)


# What each pass removes: True when the construct it rewrites is still in the graph.
CONSTRUCT: dict[str, Callable[[fx.Graph], bool]] = {
    "inline_empty_constants": lambda g: any(n.op == "placeholder" and n.name.startswith("constant_") for n in g.nodes),
    "functionalize": lambda g: any(n.op == "call_function" and functional_variant(n.target) is not None
                                   for n in g.nodes),
    "inline_grad_regions": lambda g: bool(calls(g, torch.ops.higher_order.wrap_with_set_grad_enabled)),
    "drop_assertions": lambda g: bool(calls(g, aten._assert_tensor_metadata.default)),
    "fold_constant_masks": lambda g: any(n.args[3] is not None or n.kwargs.get("attn_mask") is not None
                                         for n in calls(g, aten.scaled_dot_product_attention.default)),
    "means_to_sums": lambda g: bool(calls(g, aten.mean.default) or calls(g, aten.mean.dim)
                                    or any(_reduction(n, 2) == 1 for n in calls(g, aten.mse_loss.default))
                                    or any(_reduction(n, 3) == 1 for n in calls(g, aten.cross_entropy_loss.default))),
    "fuse_routed_experts": lambda g: bool(calls(g, torch.ops.transformers.grouped_mm_fallback.default)),
    "squeeze_dims": lambda g: bool(calls(g, aten.squeeze.default)),
}


def test_passes_are_named_uniquely_and_documented_in_order() -> None:
    """Each entry names its function, the function of that name in the module of that name (one module a pass);
    names are unique; the package docstring lists them in run order."""
    names = [p.name for p in PASSES]
    assert len(set(names)) == len(names), names
    for p in PASSES:
        assert p.run is getattr(getattr(capmod, p.name), p.name), f"pass {p.name!r} runs {p.run.__name__}"
        assert p.run.__module__ == f"{capmod.__name__}.{p.name}", p.run.__module__
        assert p.purpose and "\n" not in p.purpose
    doc = capmod.__doc__ or ""
    where = [doc.find(f"``{name}``") for name in names]
    assert -1 not in where and where == sorted(where), f"docstring order {where} for {names}"
    assert set(CONSTRUCT) == set(names), "every pass needs a construct in the toy model"


def test_capture_runs_exactly_the_pass_list_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``capture`` runs what ``PASSES`` holds, in its order, and nothing else."""
    ran: list[str] = []

    def recorded(p: Pass) -> Pass:
        def run(gm: fx.GraphModule) -> None:
            ran.append(p.name)
            p.run(gm)

        return p._replace(run=run)

    monkeypatch.setattr(capmod, "PASSES", tuple(recorded(p) for p in PASSES))
    model, inputs = toy()
    capture(model, inputs)
    assert ran == [p.name for p in PASSES]


def test_full_pipeline_rewrites_every_construct_and_keeps_the_loss() -> None:
    """No construct is left; the mask became ``is_causal``; losses are sums over counts of equal value."""
    cap = captured()
    g = cap.graph
    assert not [name for name, present in CONSTRUCT.items() if present(g)]
    (sdpa,) = calls(g, aten.scaled_dot_product_attention.default)
    assert sdpa.args[3] is None and sdpa.args[5] is True
    assert calls(g, aten.detach.default), "the no-grad region's output is detached"
    assert len(calls(g, aten.div.Tensor)) >= 3  # one per mean loss (the model's own / SEQ is a fourth)
    assert calls(g, aten.slice_scatter.default) and calls(g, aten.empty.memory_format) and not cap.constants
    model, inputs = toy()
    state = dict(model.named_parameters())
    flat = [state[cap.params[n.name]] for n in g.nodes if n.op == "placeholder" and n.name in cap.params]
    (got,) = cap.graph_module(*flat, *inputs)
    torch.testing.assert_close(got, model(*inputs), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("left_out", [p.name for p in PASSES])
def test_leaving_out_a_pass_leaves_exactly_its_construct(left_out: str) -> None:
    """Every pass has an effect of its own: without it, its construct stays and only its construct."""
    g = captured(left_out).graph
    present = sorted(name for name, check in CONSTRUCT.items() if check(g))
    assert present == [left_out]


class _Sums(nn.Module):
    """Three returned values: a mean loss (a sum scaled by a constant, then returned), a sum also read again
    (not a returned sum: something reads it), and a plain activation returned as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        s = h.sum()
        return h.square().mean(), s * s, h


def test_returned_sums_are_marked_once_by_capture() -> None:
    """``mark_returned_sums``: exactly the values whose one reader is the output, or a constant scaling read only
    by the output, carry the mark; the planning graph's lazy reads are those (``graph.Edge.lazy``)."""
    from soybean.capture.passes.mark_returned_sums import RETURNED_SUM
    from soybean.cost.profiles import load_profile
    from soybean.graph import build
    from soybean.mesh import Mesh

    cap = capture(_Sums(), (torch.randn(BATCH, HIDDEN),))
    marked = {n.name for n in cap.graph.nodes if n.meta.get(RETURNED_SUM)}
    by_name = {n.name: n for n in cap.graph.nodes}
    # the mean's sum (scaled by 1/count, then returned) and the two values the output reads directly
    assert len(marked) == 3, marked
    assert any(by_name[m].target is aten.sum.dim_IntList for m in marked)
    assert not any(by_name[m].target is aten.sum.default for m in marked)  # ``s`` is read by the multiplication
    g = build(cap, Mesh((2,)), load_profile(None))
    lazy = {g.vars[e.src].name for e in g.edges if e.lazy}
    assert lazy == marked


class _UnusedLayer(nn.Module):
    """BigBird-Pegasus's construct: forward builds a layer it never calls (its weight's ``kaiming_uniform_`` into a
    fresh tensor), beside a buffer forward writes in place (state: kept)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("seen", torch.zeros(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nn.Linear(HIDDEN, HIDDEN)  # made and dropped
        self.seen.fill_(1.0)
        return (self.lin(x) + self.seen).sum()


def test_unread_writes_into_fresh_tensors_are_dropped_and_writes_into_state_kept() -> None:
    from soybean.capture.passes.drop_assertions import dead_write

    x = torch.randn(BATCH, HIDDEN)
    cap = capture(_UnusedLayer(), (x,))
    g = cap.graph_module.graph
    assert not calls(g, aten.uniform_.default) and not calls(g, aten.empty.memory_format)
    assert calls(g, aten.fill_.Scalar)  # the buffer's write is state
    # the rule itself: a write into a fresh tensor nobody reads is dead, one into a placeholder is not
    graph = fx.Graph()
    p = graph.placeholder("p")
    fresh = graph.call_function(aten.empty.memory_format, ([2],))
    dead = graph.call_function(aten.uniform_.default, (graph.call_function(aten.detach.default, (fresh,)), 0.0, 1.0))
    kept = graph.call_function(aten.uniform_.default, (p, 0.0, 1.0))
    graph.output(None)
    assert dead_write(dead) == [dead, dead.args[0], fresh]
    assert dead_write(kept) is None
