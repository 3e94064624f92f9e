"""Views on tiles: a view the serial graph allows may be impossible on a rank's tile, whose layout is not the serial
value's (issue 26).

nanoGPT's attention ends in ``y.transpose(1, 2).contiguous().view(B, T, C)``.  On the CPU the serial attention
returns ``(B, T, H, D)`` storage for its ``(B, H, T, D)`` result, so the transpose is already contiguous and
``torch.export`` drops the ``contiguous``; on a tile that a reshard collective or the runtime's query-rows
attention returned contiguous, the transpose is not, and ``view`` raised "view size is not compatible with input
tensor's size and stride".  ``rules.views.may_copy`` marks such views from the captured graph; the program runs
them as ``reshape`` and the cost model prices the copy (``cost.compute.copy_seconds``).

The model below is our own minimal nanoGPT (fused ``c_attn`` split into q, k, v, causal SDPA, GELU MLP, LayerNorm,
tied ``wte``/``lm_head``, cross-entropy inside or outside the model).  Training runs in float64: the key bias's
gradient is zero up to rounding (softmax ignores a constant added to every key), and AdamW's normalised step turns
float32 rounding noise into a full-size update, so float32 parameters would differ by noise alone.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from soybean.capture.core import Captured, capture
from soybean.cost.compute import copy_seconds
from soybean.cost.profiles import load_profile
from soybean.graph import build
from soybean.mesh import Mesh
from soybean.plan import Plan
from soybean.planner.core import plan as make_plan
from soybean.rules.base import Strategy, expand, node_spec, op_name, strategies_1d
from soybean.rules.views import RESHAPES, may_copy
from soybean.tiling import R
from soybean.verify.testing import Trace, compare

pytestmark = pytest.mark.unit

VOCAB, EMBD, HEADS, LAYERS, BLOCK, BATCH = 64, 64, 4, 2, 8, 2


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: returns the mean cross-entropy when given targets, else the logits."""

    def __init__(self, vocab: int = VOCAB, n_embd: int = EMBD, n_head: int = HEADS, n_layer: int = LAYERS,
                 block: int = BLOCK) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        _, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt(inside: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """The float64 model, its example inputs (with the targets when the loss is inside) and the targets."""
    torch.manual_seed(0)
    model = GPT().double()
    idx, tgt = torch.randint(0, VOCAB, (BATCH, BLOCK)), torch.randint(0, VOCAB, (BATCH, BLOCK))
    return model, ((idx, tgt) if inside else (idx,)), tgt


def _loss(m: nn.Module, inputs: tuple, tgt: torch.Tensor) -> torch.Tensor:
    """The loss inside the model, or the logits' cross-entropy taken outside (as a training loop over ``out``)."""
    if len(inputs) == 2:
        return m(*inputs)
    logits = m(*inputs)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))


def _fit(m: nn.Module, inputs: tuple, tgt: torch.Tensor, grads_of: Callable[[nn.Module], dict],
         steps: int = 3) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    losses, grads = [], {}
    for i in range(steps):
        loss = _loss(m, inputs, tgt)
        loss.backward()
        if i == 0:
            grads = grads_of(m)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, grads


def serial_trace(model: nn.Module, inputs: tuple, tgt: torch.Tensor, steps: int = 3) -> Trace:
    m = copy.deepcopy(model)
    losses, grads = _fit(m, inputs, tgt, lambda s: {k: p.grad.clone() for k, p in s.named_parameters()}, steps)
    return Trace(losses, grads, {k: p.detach().clone() for k, p in m.named_parameters()}, {})


def rank_trace(pm: nn.Module, model: nn.Module, inputs: tuple, tgt: torch.Tensor, steps: int = 3) -> Trace:
    """This rank's run of ``pm``: losses, full gradients after the first step, full parameters after the last."""
    from soybean.verify.testing import _gather_grads

    losses, grads = _fit(pm, inputs, tgt, _gather_grads, steps)  # type: ignore[arg-type]
    names = {k for k, _ in model.named_parameters()}
    full = pm.full_tensors()  # type: ignore[operator]
    return Trace(losses, {k: v for k, v in grads.items() if k in names}, {k: v for k, v in full.items() if k in names},
                 {})


def threads_trace(model: nn.Module, inputs: tuple, tgt: torch.Tensor, cap: Captured, p: Plan,
                  steps: int = 3) -> Trace:
    from soybean.api import parallelize
    from soybean.runtime.launch import run_threads

    return run_threads(Mesh(tuple(p.mesh)), lambda rank, groups: rank_trace(
        parallelize(model, inputs, plan=p, rank=rank, groups=groups, captured=cap), model, inputs, tgt, steps))[0]


def _reshapes(cap: Captured) -> dict[str, bool]:
    return {n.name: may_copy(n) for n in cap.graph.nodes
            if n.op == "call_function" and op_name(n.target) in RESHAPES}


# ---- which views may copy -------------------------------------------------------------------------------------------

def test_the_attention_output_views_are_marked_and_no_other() -> None:
    """nanoGPT's graph: the view after each attention's transpose (its serial input contiguous only through the
    attention's own storage order) may copy on a tile; the q, k, v views (splits of a contiguous product, no
    permutation after) and the logits' and targets' views never do."""
    model, inputs, _ = gpt(True)
    cap = capture(model, inputs)
    marked = _reshapes(cap)
    after_attention = {n.name for n in cap.graph.nodes if n.name in marked and n.args[0].target
                       is torch.ops.aten.transpose.int and "scaled_dot_product" in n.args[0].args[0].name}
    assert len(after_attention) == LAYERS
    assert {k for k, v in marked.items() if v} == after_attention


class _Heads(nn.Module):
    """Heads permuted after a product: ``merge`` says how they are merged back."""

    def __init__(self, merge: str) -> None:
        super().__init__()
        self.w, self.merge = nn.Linear(16, 16), merge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w(x).view(2, 8, 4, 4).transpose(1, 2)
        if self.merge == "contiguous":
            return h.contiguous().view(2, 4, 32)
        return h.reshape(2, 4, 32)


@pytest.mark.parametrize("merge,copies", [("contiguous", False), ("reshape", True)])
def test_a_contiguous_copy_resets_the_layout_and_a_serial_copy_is_a_copy(merge: str, copies: bool) -> None:
    """A permuted product made contiguous (export keeps the ``clone``) is viewable on any tile: not marked.  The same
    heads merged by ``reshape`` copy in the serial run already (their traced value has its own storage): marked."""
    cap = capture(_Heads(merge), (torch.randn(2, 8, 16),))
    merged = [n for n in cap.graph.nodes if n.op == "call_function" and op_name(n.target) in RESHAPES][-1]
    assert tuple(merged.meta["val"].shape) == (2, 4, 32)
    assert may_copy(merged) is copies


# ---- what runs and what is priced -----------------------------------------------------------------------------------

def test_the_program_runs_the_marked_views_as_reshapes_and_prices_their_copy() -> None:
    """Under the 2x2 ``comm`` plan that crashed, each rank's program runs the marked views as ``reshape`` and every
    other view as ``view``; the planning graph prices a marked view as ``copy_seconds`` of its tile under each of its
    strategies and an unmarked one as nothing."""
    from soybean.codegen.lower import lower

    model, inputs, _ = gpt(True)
    cap = capture(model, inputs)
    marked = _reshapes(cap)
    p = make_plan(None, (), captured=cap, devices=4, mesh=(2, 2), objective="comm", baselines=False)
    for rank in range(4):
        gm = lower(cap, p, rank)
        ran = {n.name: n.target for n in gm.graph.nodes if n.name in marked}
        for name, copies in marked.items():
            want = torch.ops.aten.reshape.default if copies else torch.ops.aten.view.default
            assert ran[name] is want, (rank, name, ran[name])
    mesh, profile = Mesh((2, 2)), load_profile(None)
    g = build(cap, mesh, profile)
    for v in g.vars:
        if v.name in marked:
            assert v.op is not None
            want = copy_seconds(v.op, v.strategies, mesh, profile) if marked[v.name] else 0.0 * v.compute_s
            assert want.min() > 0 or not marked[v.name]
            # a copy: a build's shared cost arrays are read-only, which torch warns of when it wraps one
            torch.testing.assert_close(torch.tensor(v.compute_s), torch.as_tensor(want), rtol=1e-12, atol=0)



def test_a_graph_is_walked_for_its_layouts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``may_copy`` walks a captured graph once, whoever asks and of which op: planning and four ranks' lowerings of
    the idiom walk it once in all (lowering asked it of every op, and each op that is not a view walked the whole
    graph again: a 48-layer GPT-2 took 25 s to lower)."""
    from soybean.codegen.lower import lower
    from soybean.rules import views

    walks: list[int] = []
    walk = views._mark_layouts
    monkeypatch.setattr(views, "_mark_layouts", lambda graph: (walks.append(1), walk(graph))[1])
    model, inputs, _ = gpt(True)
    cap = capture(model, inputs)
    p = make_plan(None, (), captured=cap, devices=4, mesh=(2, 2), objective="comm", baselines=False)
    for rank in range(4):
        lower(cap, p, rank)
    assert all(views.MAY_COPY in n.meta for n in cap.graph.nodes if n.op == "call_function")
    assert len(walks) == 1

# ---- every strategy of the idiom on 2x2 -----------------------------------------------------------------------------

class _Idiom(nn.Module):
    """One nanoGPT attention and a squared-error loss."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.attn(x), y)


def _set(p: Plan, name: str, s: Strategy) -> None:
    """Force op ``name``'s strategy in ``p``."""
    p.nodes[name] = {"in": [[str(q) for q in t] for t in s.inputs], "out": [[str(q) for q in t] for t in s.outputs],
                     **({"variant": s.variant} if s.variant else {})}


def _strategies(cap: Captured, name: str, mesh: Mesh) -> list[Strategy]:
    node = next(n for n in cap.graph.nodes if n.name == name)
    op = node_spec(node)
    return expand(op, mesh, strategies_1d(op))


@pytest.mark.sim
def test_every_strategy_of_the_attention_output_view_runs_as_serial_on_2x2() -> None:
    """The idiom (attention, transpose, view) on a 2x2 mesh with the view's strategy forced to each of its 24, the
    transpose giving it that input tiling, and the attention run under each of its variants (plain, query rows,
    ring, zig-zag: each its own output layout) with the tiling that feeds the transpose directly where one does;
    then every attention strategy with the view fed directly where it can be: one AdamW step equals serial's
    loss and gradients (float64).  Before ``may_copy``, the row-split and resharded cases raised in ``view``."""
    torch.manual_seed(0)
    model = _Idiom().double()
    inputs = (torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64))
    cap = capture(model, inputs)
    mesh = Mesh((2, 2))
    base = make_plan(None, (), captured=cap, devices=4, mesh=(2, 2), objective="comm", baselines=False)
    sdpa, tr, view = (next(n.name for n in cap.graph.nodes if n.name.startswith(k))
                      for k in ("scaled_dot_product_attention", "transpose_3", "view_3"))
    assert may_copy(next(n for n in cap.graph.nodes if n.name == view))
    attention, transposes, views = (_strategies(cap, n, mesh) for n in (sdpa, tr, view))
    variants = sorted({s.variant for s in attention})
    assert variants == ["", "ring", "ring_zigzag", "zigzag"]

    def transpose_into(t: tuple) -> Strategy:
        return next(s for s in transposes if s.outputs[0] == t)

    cases: list[tuple[Strategy, Strategy, Strategy]] = []
    for v in views:
        t = transpose_into(v.inputs[0])
        for variant in variants:
            mine = [s for s in attention if s.variant == variant]
            cases.append((next((s for s in mine if s.outputs[0] == t.inputs[0]), mine[0]), t, v))
    for a in attention:
        fed = [v for v in views if transpose_into(v.inputs[0]).inputs[0] == a.outputs[0]]
        v = fed[0] if fed else views[0]
        cases.append((a, transpose_into(v.inputs[0]), v))
    serial = serial_trace(model, inputs, torch.empty(0), steps=1)
    failed = []
    for a, t, v in dict.fromkeys(cases):  # each distinct case once (96 of the 144 listed)
        p = Plan.from_dict(base.to_dict())
        for name, s in ((sdpa, a), (tr, t), (view, v)):
            _set(p, name, s)
        bad = compare(serial, threads_trace(model, inputs, torch.empty(0), cap, p, steps=1), rtol=1e-9, atol=1e-12)
        if bad:
            failed.append((a, t, v, bad[:2]))
    assert len(cases) == len(views) * len(variants) + len(attention)
    assert not failed, failed[:3]


class _Chunks(nn.Module):
    """Longformer's ``_chunk``: overlapping windows of a transposed projection, read by ``as_strided`` with the
    strides the serial tensor has (a ``(batch, seq, hidden)`` view of ``(seq, batch, hidden)`` storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).transpose(0, 1)  # (2, 8, 16), strides (16, 32, 1)
        h = h.view(h.size(0), h.size(1) // 4, 4, h.size(2))  # chunks of 4 tokens
        size, stride = list(h.size()), list(h.stride())
        size[1], stride[1] = 2 * size[1] - 1, stride[1] // 2  # and the chunks overlapping them by half
        return F.mse_loss(h.as_strided(size, stride), y)


@pytest.mark.sim
def test_as_strided_reads_its_input_laid_out_as_serial_under_every_split_before_it() -> None:
    """``as_strided`` reads storage, so its (whole) input must lie as the serial one did: with the projection split
    every way it can be on 2 devices, the value gathered for it is contiguous where serial's was a transposed view,
    and the program lays it out again (``runtime.layouts``).  One AdamW step equals serial's loss and gradients
    (float64); before, the split cases read other elements (Longformer under ``objective="comm"``)."""
    torch.manual_seed(0)
    model = _Chunks().double()
    inputs = (torch.randn(8, 2, 16, dtype=torch.float64), torch.randn(2, 3, 4, 16, dtype=torch.float64))
    cap = capture(model, inputs)
    base = make_plan(None, (), captured=cap, devices=2, objective="comm", baselines=False)
    linear = next(n.name for n in cap.graph.nodes if n.name.startswith("linear"))
    serial = serial_trace(model, inputs, torch.empty(0), steps=1)
    failed, split = [], 0
    for st in _strategies(cap, linear, Mesh((2,))):
        p = Plan.from_dict(base.to_dict())
        _set(p, linear, st)
        split += any(not isinstance(q, type(R)) for q in st.outputs[0])
        bad = compare(serial, threads_trace(model, inputs, torch.empty(0), cap, p, steps=1), rtol=1e-9, atol=1e-12)
        if bad:
            failed.append((st, bad[:2]))
    assert split >= 2 and not failed, failed[:3]


def test_as_strided_reads_are_exact_only_within_their_inputs_elements() -> None:
    """``reads_within``: a dense value (contiguous or a permutation of it) covers what a read inside its span reads;
    a read past its last element, or a value that is a slice of larger storage, does not."""
    from soybean.runtime.layouts import reads_within, sb_as_strided

    assert reads_within((2, 8, 16), (16, 32, 1), 0, (2, 3, 4, 16), (16, 64, 32, 1), 0)
    assert not reads_within((2, 8, 16), (16, 32, 1), 0, (2, 3, 4, 16), (16, 64, 32, 1), 200)  # past the end
    assert not reads_within((4, 8), (16, 1), 0, (4, 8), (16, 1), 0)  # the left half of a (4, 16) tensor
    serial = torch.randn(8, 2, 16).transpose(0, 1)
    want = serial.as_strided((2, 3, 4, 15), (16, 64, 32, 1), 1)  # an explicit offset: one element in
    got = sb_as_strided(serial.contiguous(), (2, 3, 4, 15), (16, 64, 32, 1), 1, serial_stride=serial.stride(),
                        serial_offset=0)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"as_strided reads storage outside its input .* Fix: "):
        _lowered(_Rows(), (torch.randn(4, 16),), devices=2)
    assert "as_strided" in _lowered(_Rows(), (torch.randn(4, 16),), devices=1).code  # one device: serial's value


class _Rows(nn.Module):
    """The left half of a (4, 16) tensor read back whole through its storage: ``as_strided`` past its input's
    elements."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x[:, :8]  # a view into x's storage
        return half.as_strided((4, 16), (16, 1)).square().sum()


def _lowered(model: nn.Module, inputs: tuple, devices: int) -> torch.fx.GraphModule:
    from soybean.codegen.lower import lower

    cap = capture(model, inputs)
    return lower(cap, make_plan(None, (), captured=cap, devices=devices, baselines=False), 0)


# ---- the model trains as serial ---------------------------------------------------------------------------------------

@pytest.mark.sim
@pytest.mark.parametrize("inside", [True, False], ids=["loss-inside", "loss-outside"])
@pytest.mark.parametrize("objective", ["time", "comm"])
@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["2", "2x2"])
def test_gpt_trains_as_serial(mesh: tuple[int, ...], objective: str, inside: bool) -> None:
    """nanoGPT on 2 devices and on a 2x2 mesh, under the default objective and ``comm``, with the loss inside the
    model and taken outside from its logits: losses, gradients and parameters after 3 AdamW steps equal serial's."""
    model, inputs, tgt = gpt(inside)
    cap = capture(model, inputs)
    p = make_plan(None, (), captured=cap, devices=math.prod(mesh), mesh=mesh, objective=objective, baselines=False)
    assert not compare(serial_trace(model, inputs, tgt), threads_trace(model, inputs, tgt, cap, p),
                       rtol=1e-9, atol=1e-12)


def _train_gpt(rank: int, world: int) -> list[Trace]:
    import soybean

    torch.set_num_threads(1)
    traces = []
    for inside in (True, False):
        model, inputs, tgt = gpt(inside)
        pm = soybean.parallelize(model, inputs, devices=world, mesh=(2, 2), objective="comm")
        traces.append(rank_trace(pm, model, inputs, tgt))
    return traces


@pytest.mark.dist
def test_gpt_trains_as_serial_on_4_gloo_processes_2x2_comm() -> None:
    """The reported run: 4 gloo processes, ``soybean.parallelize(..., mesh=(2, 2), objective="comm")``, with the loss
    inside the model and outside it (one process group for both: its start-up was half of each run); every rank's
    losses, gradients and parameters after 3 AdamW steps equal serial's."""
    from soybean.runtime.launch import spawn

    serial = [serial_trace(*gpt(inside)) for inside in (True, False)]
    for got in spawn(_train_gpt, 4, timeout_s=300):
        for want, trace, where in zip(serial, got, ("inside", "outside")):
            assert not compare(want, trace, rtol=1e-9, atol=1e-12), f"loss {where}"
