"""``torch.compile(model, backend=soybean.compile_backend())`` in a loop written for one device: the optimizer is
built on ``model.parameters()``, the loss is computed outside the model, and a data-dependent branch and a
``print`` break the graph.  On 2 gloo processes, training equals serial training."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.dist


class Branchy(nn.Module):
    """Two pieces around a graph break: a data-dependent branch and a print."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if h.mean() > 0:  # data-dependent Python control flow: dynamo breaks the graph here
            h = h * 1.5
        print(end="")  # and here
        return self.c(h)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2048, 64, generator=g, dtype=torch.float64), torch.randint(0, 4, (2048,), generator=g)


def _train(model: nn.Module, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    x, y = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in getattr(model, "_orig_mod", model).state_dict().items()}


def _ranks(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], int, list[list]]:
    import soybean

    torch.manual_seed(0)
    model = Branchy().double()
    pieces = []
    backend = soybean.compile_backend()

    def counting(gm, example_inputs):
        pieces.append(len(gm.graph.nodes))
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, dynamic=False)
    losses, state = _train(compiled)
    return losses, state, len(pieces), [[rec["out"] for rec in p.nodes.values()] for p in backend.plans]


def _compiled_training_with_graph_breaks_equals_serial(got: list) -> None:
    torch.manual_seed(0)
    serial_losses, serial_state = _train(Branchy().double())
    torch._dynamo.reset()
    for losses, state, pieces, outs in got:
        assert pieces >= 2  # the break split the forward
        # The pieces run split: ops work on half the batch of 2,048 (stored parameters stay whole: mode replicated).
        assert any(["S(0)"] in node for piece in outs for node in piece), outs
        assert losses == pytest.approx(serial_losses, rel=1e-9)
        for k, v in serial_state.items():
            assert torch.allclose(state[k], v, rtol=1e-9, atol=1e-12), k


def _hf_ranks(rank: int, world: int, name: str) -> tuple[list[float], int]:
    import soybean
    from tests.test_hf_defaults import CONFIGS, _steps

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    backend = soybean.compile_backend()
    losses, _ = _steps(torch.compile(model, backend=backend, dynamic=False), ids)
    return losses, len(backend.plans)


def _compiled_hugging_face_models_train_like_serial(name: str, got: list) -> None:
    """The test suite's Hugging Face causal LMs as users load them (default configs, ``use_cache=True``), the loss
    outside from ``out.logits``, plain SGD on ``model.parameters()``: 2 gloo processes equal serial."""
    import transformers

    from tests.test_hf_defaults import CONFIGS, _steps

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    serial, _ = _steps(model, ids)
    for losses, pieces in got:
        assert pieces >= 1
        assert losses == pytest.approx(serial, rel=1e-5)


def _no_break_ranks(rank: int, world: int) -> tuple[float, float, list, list]:
    import soybean
    from examples.models import mlp

    model, (x, _) = mlp(batch=512, hidden=128, layers=2)
    backend = soybean.compile_backend()
    torch.compile(model, backend=backend, dynamic=False)(x).sum().backward()
    (piece,) = backend.plans
    direct = soybean.plan(model, (x,), world, mode="replicated", baselines=False)
    return (piece.cost["step_time_s"], direct.cost["step_time_s"], sorted(map(str, piece.params.values())),
            sorted(map(str, direct.params.values())))


def _without_breaks_the_backend_finds_parallelizes_plan_under_replicated_storage(got: list) -> None:
    for piece_s, direct_s, piece_params, direct_params in got:
        assert piece_s == pytest.approx(direct_s, rel=1e-9)
        assert piece_params == direct_params and set(map(str, piece_params)) == {"['R']"}


HF = ("gpt2", "llama", "qwen2")


def _cases(rank: int, world: int, hf: bool) -> dict[str, object]:
    """Every case in turn on this one process group (their start-up was most of each run), dynamo's caches reset
    before each as a fresh process has them."""
    out: dict[str, object] = {}
    for name, run in (("branchy", _ranks), ("no_break", _no_break_ranks)):
        torch._dynamo.reset()
        out[name] = run(rank, world)
    for name in HF if hf else ():
        torch._dynamo.reset()
        out[name] = _hf_ranks(rank, world, name)
    return out


def test_compiled_training_equals_serial() -> None:
    """On 2 gloo processes, each case as its function says: training through graph breaks (a data-dependent branch
    and a print) equals serial; without breaks the backend finds ``parallelize``'s plan under replicated storage;
    the test suite's Hugging Face causal LMs as users load them (default configs, ``use_cache=True``), the loss
    outside from ``out.logits``, plain SGD on ``model.parameters()``, equal serial (when transformers is there)."""
    from soybean.runtime.launch import spawn

    try:
        import transformers  # noqa: F401
        hf = True
    except ImportError:
        hf = False
    torch._dynamo.reset()
    got = spawn(_cases, 2, hf, timeout_s=600)
    _compiled_training_with_graph_breaks_equals_serial([r["branchy"] for r in got])
    _without_breaks_the_backend_finds_parallelizes_plan_under_replicated_storage([r["no_break"] for r in got])
    for name in HF if hf else ():
        _compiled_hugging_face_models_train_like_serial(name, [r[name] for r in got])
