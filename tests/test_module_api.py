"""One module API for every plan kind (issue 24): whatever ``parallelize`` returns (``ParallelModule``,
``PipelinedModule``, ``PlacedModule``, ``PiecesModule``) trains through ``train_step`` on ``parameters()``, and its
``full_state_dict()`` is the serial model's ``state_dict()`` (the model's own keys, whole tensors, on every rank),
``load_full_state_dict`` takes one back, ``save_sharded``/``load_sharded`` restore a fresh module, optimizer
state included, ``grad_norm``/``clip_grad_norm_`` are the serial model's (torch's own over ``parameters()`` sees
one rank's tiles), and an optimizer that reads whole weights (Adafactor) is refused where the plan splits some.

The model has what a model run in parts finds hardest: a buffer and a frozen weight that every branch of both
blocks reads (a copy in each stage or region that reads them, which must come back once, equal to serial) and a
layer forward never reads (in no part: its tensors must come back all the same)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from soybean.runtime.launch import spawn

pytestmark = pytest.mark.dist

WIDTH, CLASSES, BATCH, STEPS, LR = 8, 4, 4, 3, 1e-2
CLIP = 0.5  # below every step's gradient norm (1.00, 0.89, 0.81, 0.76 unclipped): the clipping binds
KINDS = {"plain": "ParallelModule", "pipelined": "PipelinedModule", "placed": "PlacedModule",
         "pieces": "PiecesModule"}


class _Block(nn.Module):
    """Two branches (placeable on their own groups) reading the model's shared ``scale`` and ``shift``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x) * scale + shift) + torch.tanh(self.b(x) * scale - shift)


class _Net(nn.Module):
    """Two blocks (two pipeline stages; four placed branches), a head, a buffer and a frozen weight every branch
    reads, and ``spare``, which forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(WIDTH) for _ in range(2))
        self.register_buffer("scale", torch.rand(WIDTH) + 0.5)
        self.shift = nn.Parameter(torch.randn(WIDTH) * 0.1, requires_grad=False)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.spare = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.scale, self.shift)
        return self.head(x)


def _model(seed: int) -> tuple[_Net, torch.Tensor, torch.Tensor]:
    """The model (float64) with weights of ``seed``; the batch is always seed 0's."""
    torch.manual_seed(seed)
    model = _Net().double()
    torch.manual_seed(0)
    return model, torch.randn(BATCH, WIDTH, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,))


def _copy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def _serial(steps: int) -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    """The serial model's ``state_dict()`` after ``steps`` AdamW steps on the loss outside, each clipped to norm
    ``CLIP`` by torch, and each step's (largest gradient, 2-norm) before clipping."""
    model, x, y = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        top = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
        norms.append((top, float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))))
        opt.step()
    return _copy(model.state_dict()), norms


def _placed_plan() -> str:
    """The placed plan of the model on 2 devices, every parallel segment's branches on groups of 1 and 1 (made
    here, once, so both ranks run the same one)."""
    from soybean.capture.core import capture
    from soybean.options import options
    from soybean.parts.placement_plan import plan_placement

    model, x, _ = _model(0)
    plan = plan_placement(capture(model, (x,)), 2, options(None, devices=2), sizes=(1, 1))
    assert plan is not None and plan.placement is not None
    assert sorted({tuple(r["ranks"]) for r in plan.placement["regions"]}) == [(0,), (0, 1), (1,)]
    return plan.to_json()


def _parallel(kind: str, model: nn.Module, x: torch.Tensor, world: int, plan: Any) -> Any:
    """``parallelize`` asked for ``kind`` (or running ``plan``, a Plan or its JSON)."""
    import soybean
    from soybean.plan import Plan

    if isinstance(plan, str):
        plan = Plan.from_dict(json.loads(plan))
    if plan is not None:
        return soybean.parallelize(model, (x,), devices=world, plan=plan)
    if kind == "pipelined":
        return soybean.parallelize(model, (x,), devices=world, pipeline=world, microbatches=2)
    if kind == "pieces":
        return soybean.parallelize(model, (x,), devices=world, capture_with="dynamo")
    return soybean.parallelize(model, (x,), devices=world, objective="comm")  # its weights split (time's: whole)


def _steps(pm: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int
           ) -> list[tuple[float, float]]:
    """``steps`` steps, each clipped by the module's own ``clip_grad_norm_``; each step's (inf-norm, 2-norm)."""
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        pm.train_step(x, loss_fn=F.cross_entropy, target=y)
        norms.append((float(pm.grad_norm(float("inf"))), float(pm.clip_grad_norm_(CLIP))))
        opt.step()
    return norms


def _contract(rank: int, world: int, kind: str, plan: str | None, root: str) -> dict[str, Any]:
    """Train ``kind`` ``STEPS`` steps and read its state; save it sharded, load it into a fresh module (a model of
    other weights) and step both once more; load full state dicts back into the trained one."""
    import warnings

    torch.set_num_threads(1)
    torch._dynamo.reset()
    warnings.simplefilter("ignore")  # the pieces' "captured by dynamo" warning
    model, x, y = _model(0)
    pm = _parallel(kind, model, x, world, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    norms = _steps(pm, opt, x, y, STEPS)
    out: dict[str, Any] = {"type": type(pm).__name__, "trained": _copy(pm.full_state_dict()), "norms": norms}
    pm.save_sharded(root, optimizer=opt)
    other, _, _ = _model(1)
    out["start"] = _copy(other.state_dict())
    fresh = _parallel(kind, other, x, world, pm.plan)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=LR)
    out["fresh"] = _copy(fresh.full_state_dict())
    fresh.load_sharded(root, optimizer=opt2)
    out["loaded"] = _copy(fresh.full_state_dict())
    _steps(pm, opt, x, y, 1)
    _steps(fresh, opt2, x, y, 1)  # AdamW's moments came back too: the next step is the trained module's
    out["after"] = (_copy(pm.full_state_dict()), _copy(fresh.full_state_dict()))
    pm.load_full_state_dict(out["start"])
    out["back_start"] = _copy(pm.full_state_dict())
    pm.load_full_state_dict(out["after"][0])
    out["back"] = _copy(pm.full_state_dict())
    try:  # an optimizer that reads whole weights, at its first step: refused where the plan splits some
        torch.optim.Adafactor(pm.parameters()).step()
        out["adafactor"] = None
    except ValueError as e:
        out["adafactor"] = f"{type(e).__name__}: {e}"
    return out


def _contracts(rank: int, world: int, placed_plan: str, root: str) -> dict[str, dict[str, Any]]:
    """``_contract`` of every plan kind, one after another in this one process group, each checkpoint in a
    directory of its own: spawning the processes once, not once per kind (their start-up was most of each run)."""
    return {kind: _contract(rank, world, kind, placed_plan if kind == "placed" else None, f"{root}/{kind}")
            for kind in KINDS}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, exact: bool = True) -> None:
    assert list(got) == list(want), what  # the model's own keys, in its order
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, (what, k)
        if exact:
            assert torch.equal(got[k], v), (what, k)
        else:
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12, msg=f"{what}: {k}")


def test_every_plan_kind_has_the_serial_state_dict_and_checkpoints(tmp_path: Path) -> None:
    """2 gloo processes, float64, ``STEPS`` AdamW steps through ``train_step``, each clipped by the module's
    ``clip_grad_norm_``, for every plan kind (one spawn runs them all, in turn): every step's gradient norms (2 and
    inf) are the serial model's; ``full_state_dict()`` on every rank is the serial model's ``state_dict()`` trained
    alike (keys, order, every tensor); a sharded checkpoint loads into a fresh module of other weights (equal to
    what was saved, and the next step equal); and ``load_full_state_dict`` round-trips."""
    want, norms = _serial(STEPS)
    assert all(n > CLIP for _, n in norms)
    got = spawn(_contracts, 2, _placed_plan(), str(tmp_path / "ckpt"), timeout_s=600)
    start = _model(1)[0].state_dict()
    assert any(not torch.equal(start[k], v) for k, v in want.items())  # the fresh module starts elsewhere
    for rank, by_kind in enumerate(got):
        assert list(by_kind) == list(KINDS)
        for kind, r in by_kind.items():
            what = f"{kind} on rank {rank}"
            assert r["type"] == KINDS[kind], what
            flat = [v for pair in r["norms"] for v in pair]  # the serial norms, clipped as serially
            assert flat == pytest.approx([v for pair in norms for v in pair], rel=1e-10), what
            _same(r["trained"], want, f"{what}: trained", exact=False)
            _same(r["fresh"], r["start"], f"{what}: fresh")
            _same(r["start"], start, f"{what}: start")
            _same(r["loaded"], r["trained"], f"{what}: loaded")
            _same(r["after"][1], r["after"][0], f"{what}: after")
            _same(r["back_start"], r["start"], f"{what}: back_start")
            _same(r["back"], r["after"][0], f"{what}: back")
            # Only the plain plan (objective comm) splits weights; the parts' are on one device each.
            refused = r["adafactor"] is not None and r["adafactor"].startswith("OptimizerError: Adafactor")
            assert refused == (kind == "plain"), (what, r["adafactor"])
