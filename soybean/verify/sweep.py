"""The architecture sweep: does each architecture of ``models.archs`` train with soybean exactly as it does alone?

For one architecture (``sweep_arch``):

* ``check``: every strategy of every rule its graph uses, on simulated ranks in float64 (``soybean.verify.check``);
* ``time`` and ``comm``: ``soybean.parallelize(model, kwargs, devices=N, objective=...)`` trained for a few
  AdamW steps (``model(**kwargs).loss``), every rank a thread of this process (``tier="threads"``) or a gloo
  process (``tier="gloo"``), and the loss of every step, every gradient of the first step and every parameter
  after the last compared with the model trained alone (``differences``); ``comm`` (SoyBean's objective:
  bytes) splits parameters where the default objective, on tiny models, mostly keeps them whole.

"Equal" is judged against the float64 serial run (``differences``): the parallel float32 run must be as close to
it as the float32 serial run is.
"""
from __future__ import annotations

import copy
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from ..models import archs
from .testing import Trace, train_parallel_threads, train_serial

if TYPE_CHECKING:
    from ..capture.core import Captured, CaptureError

STEPS, LR = 3, 1e-4  # lr 1e-4: AdamW moves a parameter whose gradient is 0 up to rounding by lr (tests/test_hf.py)
OBJECTIVES = ("time", "comm")


@dataclass
class Row:
    """One architecture's results: per column ``ok``, ``FAIL: why`` or ``error: why``."""

    name: str
    family: str
    task: str
    results: dict[str, str] = field(default_factory=dict)
    split: dict[str, str] = field(default_factory=dict)   # objective -> "k/n" parameters split
    no_rule: list[str] = field(default_factory=list)        # ops that ran replicated for want of a rule
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(v == "ok" for v in self.results.values())


def _float64(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


# A parallel run is as exact as the serial one when, for every loss, gradient and parameter, its distance to the
# float64 serial run is at most SLACK times the float32 serial run's, plus the comparison's tolerance.
SLACK = 3.0
RTOL, ATOL = 1e-4, 1e-5
ZERO_GRADIENT = 1e-6


def differences(serial: Trace, exact: Trace, parallel: Trace, lr: float = LR, steps: int = STEPS) -> list[str]:
    """Where ``parallel`` (float32) is further from the float64 serial run ``exact`` than the float32 serial run
    ``serial`` is, beyond ``SLACK`` and the tolerance: the lines name the tensor and both distances.

    Why not ``parallel`` against ``serial`` directly: summing in another order rounds differently, and AdamW
    divides each gradient element by its own size, so a parameter whose gradient is zero in exact arithmetic
    (a key bias under softmax) moves by up to the learning rate on rounding noise alone -- serially as in
    parallel, in unrelated directions.  Both float32 runs are then equally far from the exact one, except where
    the float32 serial run happens to round such a gradient to exactly zero: a parameter element whose exact
    gradient is zero up to rounding (``ZERO_GRADIENT`` of the model's largest) may differ by the learning rate
    times the steps."""
    out = []
    largest = max((float(g.abs().max()) for g in exact.grads.values() if g.numel()), default=0.0)
    pairs = [("loss", dict(enumerate(serial.losses)), dict(enumerate(exact.losses)), dict(enumerate(parallel.losses)))]
    pairs += [(kind, getattr(serial, kind), getattr(exact, kind), getattr(parallel, kind))
              for kind in ("grads", "params", "buffers")]
    for kind, s32, s64, par in pairs:
        for k, want in s64.items():
            if k not in par:
                out.append(f"{kind} {k} missing")
                continue
            w = torch.as_tensor(want, dtype=torch.float64)
            p, s = torch.as_tensor(par[k]).double(), torch.as_tensor(s32[k]).double()
            if p.shape != w.shape:
                out.append(f"{kind} {k}: shape {tuple(p.shape)} != {tuple(w.shape)}")
                continue
            if not w.is_floating_point() or not w.numel():
                continue
            serial_err = float((s - w).abs().max())
            allowed = torch.full_like(w, SLACK * serial_err + ATOL + RTOL * float(w.abs().max()))
            g = exact.grads.get(str(k))
            if kind == "params" and g is not None and g.shape == w.shape:
                allowed = torch.where(g.abs().double() <= ZERO_GRADIENT * largest, allowed + lr * steps, allowed)
            err = (p - w).abs()
            if bool((err > allowed).any()):
                out.append(f"{kind} {k}: {float(err.max()):.3g} from float64 serial (float32 serial: {serial_err:.3g})")
    return out


def exact_serial(model: torch.nn.Module, example: tuple | dict, serial: Trace, steps: int = STEPS,
                 lr: float = LR) -> Trace:
    """The float64 serial run of ``model`` on ``example``; ``serial`` (the float32 run) for a model that does not
    run in float64 (then the parallel run is compared with it at the plain tolerance)."""
    try:
        return train_serial(copy.deepcopy(model).double(), tree_map(_float64, example), steps=steps, lr=lr)
    except RuntimeError:
        return serial


Example = tuple[torch.nn.Module, tuple | dict]


def build(ref: str) -> Example:
    """The model and example of a sweep row: ``arch:NAME`` (``models.archs``), ``torchtitan:llama3`` (torchtitan's
    own Llama-3, ``torchtitan_llama3``), or a model reference (``pkg.module:fn``, ``hf:NAME``: ``models.load``)."""
    if ref.startswith("arch:"):
        return archs.build(archs.BY_NAME[ref[5:]])
    if ref == "torchtitan:llama3":
        return torchtitan_llama3()
    from .. import models

    return models.load(ref)


def torchtitan_llama3(batch: int = 2, seq: int = 9) -> Example:
    """torchtitan's own Llama-3 (its debug size: dim 64, 2 layers, 4 heads, 2 of them for keys and values), with
    its loss outside the model as torchtitan's trainer computes it; ``ImportError`` where torchtitan is missing."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs  # type: ignore[import-not-found]
    from torchtitan.models.llama3.model.model import Transformer  # type: ignore[import-not-found]

    torch.manual_seed(0)
    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    titan = Transformer(args)
    titan.init_weights()
    model = _LossOutside(titan)
    ids = torch.randint(0, 128, (batch, seq))
    return model, {"tokens": ids, "labels": torch.randint(0, 128, (batch, seq))}


class _LossOutside(torch.nn.Module):
    """A model returning logits, with the cross-entropy a trainer computes on them: ``{"loss": ...}``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(tokens)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}


def _gloo_rank(rank: int, world: int, ref: str, objective: str, steps: int,
               lr: float) -> tuple[Trace, dict[str, list[str]]]:
    """One gloo rank of ``train``: build the model (same seed on every rank), parallelize, train; rank 0's trace
    and plan's parameter tilings."""
    from ..api import parallelize
    from .testing import train_parallel

    model, example = build(ref)
    pm = parallelize(model, example, devices=world, objective=objective)
    return train_parallel(pm, model, example, steps, lr), pm.plan.params


def train(ref: str, objective: str, devices: int, tier: str, steps: int = STEPS, lr: float = LR,
          exported: Captured | CaptureError | None = None,
          pieces: bool = False) -> tuple[Trace, dict[str, list[str]]]:
    """The parallel trace of the model ``ref`` names (``build``) and its plan's parameter tilings; a model
    ``parallelize`` captures in pieces (``pieces``, or ``exported`` a ``CaptureError``: export fails, or a custom
    Function must run as written, ``run.pieces.graphs``) trains on gloo processes whatever ``tier`` says (its
    pieces need a process group).  ``exported``: what exporting a model ``build`` made gave already (its capture,
    read on threads instead of capturing the fresh model again: ``build`` seeds its weights, so the graph is the
    same; or the ``CaptureError`` it raised), so that it is not tried again."""
    from ..capture.core import CaptureError, capture

    if tier != "gloo" and not pieces and not isinstance(exported, CaptureError):
        model, example = build(ref)
        if exported is None:
            try:
                exported = capture(model, example)
            except CaptureError as e:
                exported = e
        if not isinstance(exported, CaptureError):
            trace, plan = train_parallel_threads(model, example, devices=devices, objective=objective, steps=steps,
                                                 lr=lr, captured=exported)
            return trace, plan.params
    from ..runtime.launch import spawn  # gloo processes: asked, or a model in pieces (``soybean.run.pieces``)

    return spawn(_gloo_rank, devices, ref, objective, steps, lr, timeout_s=600)[0]


def sweep_arch(arch: archs.Arch, columns: tuple[str, ...] = ("check", *OBJECTIVES), devices: int = 2,
               tier: str = "threads", say: Callable[[str], None] | None = None) -> Row:
    """One architecture of the suite through ``columns`` (``check`` and objectives)."""
    return sweep(f"arch:{arch.name}", Row(arch.name, arch.family, arch.task), columns, devices, tier, say)


def sweep(ref: str, row: Row, columns: tuple[str, ...] = ("check", *OBJECTIVES), devices: int = 2,
          tier: str = "threads", say: Callable[[str], None] | None = None) -> Row:
    """The model ``ref`` names (``build``) through ``columns``, its results in ``row``."""
    from ..capture.core import CaptureError, capture
    from ..graph import fallback_ops
    from ..run.pieces import graphs
    from .check import check_model

    t0 = time.perf_counter()
    exported: Captured | CaptureError | None = None
    try:
        model, example = build(ref)
        try:  # exported once: the ops without a rule and every objective's run read what it gave
            exported = capture(model, example)
        except CaptureError as e:
            exported = e  # captured in pieces
        got = graphs(model, example, exported=exported)  # what ``parallelize`` plans: the export, or pieces
        pieces = not (len(got) == 1 and got[0] is exported)
        row.no_rule = sorted({op for graph in got for op in fallback_ops(graph)})
        serial = train_serial(model, example, steps=STEPS, lr=LR)
        exact = exact_serial(model, example, serial) if any(c in OBJECTIVES for c in columns) else serial
    except Exception as e:  # a model that does not build or capture: the row says why
        row.results["capture"] = f"error: {type(e).__name__}: {_first(e)}"
        row.seconds = time.perf_counter() - t0
        return row
    for col in columns:
        try:
            if col == "check":
                rep = check_model(model, example, devices=devices)
                row.results[col] = "ok" if rep.ok else f"FAIL: {len(rep.failures)} inexact: {rep.failures[0].message}"
                continue
            par, params = train(ref, col, devices, tier, exported=exported, pieces=pieces)
            bad = differences(serial, exact, par)
            row.split[col] = f"{sum(1 for t in params.values() if any(p != 'R' for p in t))}/{len(params)}"
            row.results[col] = "ok" if not bad else f"FAIL: {len(bad)} differ: {'; '.join(bad[:2])}"
        except Exception as e:
            row.results[col] = f"error: {type(e).__name__}: {_first(e)}"
            if say is not None:
                say(traceback.format_exc())
    row.seconds = time.perf_counter() - t0
    return row


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def table(rows: list[Row], columns: tuple[str, ...]) -> list[str]:
    """The sweep as a Markdown table: architecture, family, each column, the ops without a rule."""
    head = ["architecture", "family", *columns, "ops without a rule"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.results.get(c, r.results.get("capture", ""))
            mark = "yes" if v == "ok" else ("no" if v.startswith("FAIL") else "error")
            if c in r.split and v == "ok":
                mark += f" ({r.split[c]} split)"
            cells.append(mark)
        out.append("| " + " | ".join([r.name, r.family, *cells, ", ".join(r.no_rule) or "none"]) + " |")
    return out


def summary(rows: list[Row], columns: tuple[str, ...]) -> list[str]:
    """One line per column: how many architectures pass it."""
    return [f"{c}: {sum(1 for r in rows if r.results.get(c) == 'ok')} of {len(rows)} equal"
            + ("" if c != "check" else " (every strategy exact)") for c in columns]


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{"architecture": r.name, "family": r.family, "task": r.task, "results": r.results, "split": r.split,
             "no_rule": r.no_rule, "seconds": round(r.seconds, 1)} for r in rows]
