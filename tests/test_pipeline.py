"""Pipeline stages (``soybean.parts.stages``, ``pipeline_plan``, ``pipelined``): the stages of a capture run one after
the other are the captured graph (forward and gradients), and a pipelined plan on gloo processes trains as serial
training does (float64: the loss and every parameter after several SGD steps), for each schedule, an uneven split
of layers, and a loss computed inside the model or outside it."""
from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.models import transformer
from soybean.capture.core import capture
from soybean.parts.part import run_parts
from soybean.parts.stages import StageError, even_bounds, layers, split
from soybean.run.pipelined import check_microbatches
from soybean.runtime.launch import spawn

pytestmark = pytest.mark.unit

LAYERS = 3


def _model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = transformer(batch=4, seq=6, hidden=12, layers=LAYERS, heads=2)
    return model.double(), tuple(x.double() for x in inputs)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _steps(pm: nn.Module, steps: int, *inputs: object, **train: object) -> list[float]:
    """``steps`` SGD steps through ``pm.train_step``: the whole batch's loss of each."""
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(pm.train_step(*inputs, **train)))  # type: ignore[operator]
        opt.step()
    return losses


def _own(pm: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters this rank's stages hold, whole (the other stages' come back on the meta device)."""
    mods = [m.pm for m in pm.stage_modules] if hasattr(pm, "stage_modules") else [pm]
    names = dict(model.named_parameters())
    return {k: v.detach().clone() for m in mods for k, v in m.full_state_dict().items()  # type: ignore[operator]
            if k in names and v.device.type != "meta"}


@pytest.mark.parametrize("bounds", [[(0, 2)], [(0, 0), (1, 2)], [(0, 1), (2, 2)], [(0, 0), (1, 1), (2, 2)]])
def test_stages_run_in_order_are_the_captured_graph(bounds: list[tuple[int, int]]) -> None:
    model, inputs = _model()
    cap = capture(model, inputs)
    assert layers(cap) == [f"blocks.{i}" for i in range(LAYERS)]
    whole = [cap.params.get(n.name) or cap.buffers[n.name] for n in cap.graph.nodes
             if n.op == "placeholder" and (n.name in cap.params or n.name in cap.buffers)]
    state = _state(model)
    ref = cap.graph_module(*[state[f] for f in whole], *inputs)
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    stages = split(cap, bounds)
    got = run_parts(cap, stages, state, inputs)[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for g, r in zip(torch.autograd.grad(got, list(model.parameters())), ref_grads):
        torch.testing.assert_close(g, r)
    # each stage holds only the parameters its layers read, and hands on what a later one reads
    for a, b in zip(stages, stages[1:]):
        assert a.returns and a.returns == b.takes
    for st in stages:
        blocks = {int(f.split(".")[1]) for f in st.cap.params.values() if f.startswith("blocks.")}
        assert blocks == set(range(st.first, st.last + 1))
    owned = [set(st.cap.params.values()) for st in stages]
    assert sum(len(o) for o in owned) == len(set().union(*owned))  # no parameter in two stages


def test_cuts_that_cannot_make_stages_say_why() -> None:
    assert even_bounds(5, 2) == [(0, 2), (3, 4)]
    with pytest.raises(StageError, match="at most 3 stages"):
        even_bounds(3, 4)
    with pytest.raises(StageError, match="do not cover"):
        split(capture(*_model()), [(0, 0), (2, 2)])
    with pytest.raises(ValueError, match=r"use microbatches in \[1, 2, 3, 6\]"):
        check_microbatches(6, 4)


def serial_losses(model: nn.Module, steps: int, *inputs: torch.Tensor, scale: float = 1.0) -> list[float]:
    """``steps`` SGD steps of ``model`` (its output the loss, times ``scale``) in place: each step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs) * scale
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _serial(steps: int, outside: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, inputs = _model()
    losses = serial_losses(model, steps, *inputs, scale=2.0 if outside else 1.0)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _pipelined(rank: int, world: int, schedule: str, microbatches: int, outside: bool,
               steps: int) -> tuple[list[float], dict[str, torch.Tensor], str]:
    import soybean

    torch.set_num_threads(1)
    model, inputs = _model()
    pm = soybean.parallelize(model, inputs, devices=world, pipeline=world, microbatches=microbatches,
                             schedule=schedule)
    losses = _steps(pm, steps, *inputs, loss_fn=(lambda out: out * 2.0) if outside else (lambda out: out))
    return losses, _own(pm, model), pm.plan.to_json()


def _two_stages_on_two_processes_train_as_serial(got: list, schedule: str, microbatches: int, outside: bool) -> None:
    """3 layers over 2 stages (an uneven split: 2 and 1), 3 SGD steps in float64."""
    ref_losses, ref_params = _serial(3, outside)
    params: dict[str, torch.Tensor] = {}
    for losses, p, _ in got:
        assert losses == pytest.approx(ref_losses, rel=1e-10)
        assert not set(p) & set(params)  # each stage holds its own parameters
        params.update(p)
    assert set(params) == set(ref_params)
    for k, v in ref_params.items():
        torch.testing.assert_close(params[k], v, rtol=1e-10, atol=1e-12)
    pipe = json.loads(got[0][2])["pipeline"]
    assert pipe["schedule"] == schedule and pipe["microbatches"] == microbatches and pipe["virtual_stages"] == 1
    assert [s["units"] for s in pipe["stages"]] == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.2"]]
    assert [s["ranks"] for s in pipe["stages"]] == [[0], [1]] and all(s["mesh"] == [1] for s in pipe["stages"])


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)], nn.Linear(8, 3))
    return model.double(), torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)


def _mlp_serial(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, x, y = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _mlp_pipelined(rank: int, world: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import soybean

    torch.set_num_threads(1)
    model, x, y = _mlp()
    pm = soybean.parallelize(model, (x,), devices=world, pipeline=world, microbatches=4, schedule="gpipe")
    losses = _steps(pm, steps, x, loss_fn=nn.functional.mse_loss, target=y)
    out = pm(x)  # forward only, the whole batch's output on every rank
    with pytest.raises(RuntimeError, match="train_step"):
        out.sum().backward()
    return losses, _own(pm, model), out.detach()


def _a_loss_outside_the_model_with_its_target_trains_as_serial(got: list) -> None:
    """The model returns its output; ``loss_fn(output, target)`` runs on the last stage per microbatch, the
    target split as the inputs are (GPipe: every forward, then every backward)."""
    ref_losses, ref_params = _mlp_serial(3)
    params: dict[str, torch.Tensor] = {}
    model, x, _ = _mlp()
    model.load_state_dict(ref_params)
    for losses, p, out in got:
        assert losses == pytest.approx(ref_losses, rel=1e-10)
        torch.testing.assert_close(out, model(x).detach())
        params.update(p)
    assert set(params) == set(ref_params)
    for k, v in ref_params.items():
        torch.testing.assert_close(params[k], v, rtol=1e-10, atol=1e-12)


def test_the_command_line_plans_stages(capsys: pytest.CaptureFixture) -> None:
    """``soybean plan --pipeline 2`` on 4 devices: two stages of two devices each, their own plans inside, the
    schedule's bubble; a plan without stages has no ``pipeline`` key; a batch that does not split is one line."""
    from soybean.cli import main

    args = ["plan", "examples.models:transformer", "--arg", "batch=8", "--arg", "seq=8", "--arg", "hidden=16",
            "--arg", "layers=3", "--arg", "heads=2", "--devices", "4", "--format", "json", "--quiet"]
    assert main([*args, "--pipeline", "2", "--microbatches", "4", "--schedule", "gpipe"]) == 0
    d = json.loads(capsys.readouterr().out)
    pipe = d["pipeline"]
    assert (pipe["schedule"], pipe["microbatches"], pipe["virtual_stages"]) == ("gpipe", 4, 1)
    assert pipe["bubble"] == pytest.approx(1 / 5)
    assert [s["ranks"] for s in pipe["stages"]] == [[0, 1], [2, 3]]
    assert [s["units"] for s in pipe["stages"]] == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.2"]]
    for s in pipe["stages"]:
        assert s["plan"]["devices"] == 2 and s["plan"]["mesh"] == s["mesh"] and s["microbatch_s"] > 0
    # (the JSON rounds the cost to 6 significant digits)
    assert d["cost"]["step_time_s"] == pytest.approx(max(s["microbatch_s"] for s in pipe["stages"]) * 5, rel=1e-5)
    assert main(args) == 0
    assert "pipeline" not in json.loads(capsys.readouterr().out)
    assert main([*args, "--pipeline", "2", "--microbatches", "3"]) != 0
    assert "use microbatches in [1, 2, 4, 8]" in capsys.readouterr().err


def test_each_stage_is_planned_with_its_microbatches_in_flight() -> None:
    """1F1B's first stage of two holds 2 microbatches' activations, its last 1: each stage is planned with them
    (``PlanOptions.inflight``), its kept activations priced twice (the peak one microbatch's activations above the
    same layout's with one).  A budget that the first stage's fastest plan fits with one microbatch but not two is
    met by recomputing both its blocks (its memory with both in flight within the budget, no warning); a budget no
    plan fits with two but one does plans it with one and warns, naming the stage."""
    from soybean.api import micro_inputs
    from soybean.cost.memory import MEMORY_HEADROOM
    from soybean.options import PlanOptions
    from soybean.parts.pipeline_plan import plan_pipeline, stage_plan
    from soybean.parts.stages import even_bounds, layers, split

    model, inputs = transformer(batch=8, seq=16, hidden=32, layers=4, heads=2)
    cap = capture(model, micro_inputs(inputs, {}, 2)[0])
    _, plans, top = plan_pipeline(cap, 2, 2, 2, "1f1b", PlanOptions(devices=2))
    assert [p.inflight for p in plans] == [2, 1]
    assert [s["memory_bytes"] for s in (top.pipeline or {})["stages"]] == [p.memory["peak"] for p in plans]
    one = stage_plan(split(cap, even_bounds(len(layers(cap)), 2))[0].cap, 1, PlanOptions(devices=1), 1)
    assert one.inflight == 1 and one.recompute == plans[0].recompute == []
    assert plans[0].memory["activations"] == pytest.approx(2 * one.memory["activations"])
    assert plans[0].memory["peak"] == pytest.approx(one.memory["peak"] + one.memory["activations"])

    def gb(nbytes: float) -> float:
        return nbytes / 2**30 / (1 - MEMORY_HEADROOM)

    budget = one.memory["peak"]  # fits one microbatch's activations, not two
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, fitted, top = plan_pipeline(cap, 2, 2, 2, "1f1b", PlanOptions(devices=2, memory_gb=gb(budget)))
    assert fitted[0].inflight == 2 and fitted[0].recompute == ["blocks.0", "blocks.1"]
    assert (top.pipeline or {})["stages"][0]["memory_bytes"] <= budget
    with pytest.warns(UserWarning, match=r"pipeline stages \[0\] need up to"):
        _, tight, _ = plan_pipeline(cap, 2, 2, 2, "1f1b", PlanOptions(devices=2, memory_gb=gb(0.9 * budget)))
    assert tight[0].inflight == 1  # no plan fits two microbatches: planned with one


def test_the_stage_table_says_what_the_plan_without_stages_reached() -> None:
    """``pipeline_table``'s last line: the plan without stages' step where it was planned, its bound where a
    pipeline's step pruned it (``api.auto_plan`` under a budget), nothing where neither is known."""
    from soybean.options import PlanOptions
    from soybean.parts.pipeline_plan import plan_pipeline
    from soybean.report.table import pipeline_table

    model, inputs = transformer(batch=4, seq=6, hidden=12, layers=3, heads=2)
    top = plan_pipeline(capture(model, tuple(x[:2] for x in inputs)), 2, 2, 2, "1f1b", PlanOptions(devices=2))[2]
    assert top.pipeline is not None
    assert "without stages" not in pipeline_table(top)
    top.pipeline.update(without_stages_s=None, without_stages_bound_s=0.0123)
    assert "without stages: at least 12.3 ms (bound: not planned)" in pipeline_table(top)
    top.pipeline.update(without_stages_s=0.0456)
    assert "without stages: 45.6 ms\n" in pipeline_table(top)


def test_explain_and_draw_show_each_stage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``explain`` and ``draw`` of a pipelined plan (saved, or planned with ``--pipeline``): each stage's row of
    the table (units, ranks, mesh, time per microbatch, memory) and the schedule's bubble, then its own plan
    explained; the picture bands the stages in order."""
    from soybean.cli import main

    model = ["examples.models:transformer", "--arg", "batch=8", "--arg", "seq=8", "--arg", "hidden=16", "--arg",
             "layers=3", "--arg", "heads=2"]
    saved = tmp_path / "pp.json"
    assert main(["plan", *model, "--devices", "4", "--pipeline", "2", "--microbatches", "4", "--quiet",
                 "--out", str(saved)]) == 0
    table = capsys.readouterr().out
    assert "memory" in table.splitlines()[0] and "bubble 20.0%" in table
    assert main(["explain", *model, "--plan", str(saved)]) == 0
    text = capsys.readouterr().out
    assert text.count("== pipeline stage") == 2 and text.count("soybean explain: 2 devices") == 2
    stage1 = text[text.index("== pipeline stage 1"):]
    assert "blocks.2 .. blocks.2" in stage1 and "2,3" in stage1 and "bubble 20.0%" in stage1
    assert "blocks.2" in stage1.split("soybean explain", 1)[1] and "blocks.0" not in stage1
    pic = tmp_path / "pp.svg"
    assert main(["draw", *model, "--devices", "4", "--pipeline", "2", "--out", str(pic)]) == 0
    body = pic.read_text()
    assert body.index("pipeline stage 0") < body.index("pipeline stage 1") and body.count("<svg ") == 3
    import xml.dom.minidom

    xml.dom.minidom.parseString(body)  # well-formed


@pytest.mark.sim
@pytest.mark.parametrize("mode", ["dp", "mp"])
def test_train_step_serves_a_plan_without_stages(mode: str) -> None:
    """One loop for both: ``train_step`` on a ``ParallelModule`` (2 ranks as threads) trains as serial does."""
    from soybean import parallelize
    from soybean.mesh import Mesh
    from soybean.runtime.launch import run_threads

    ref_losses, ref_params = _mlp_serial(3)
    base, x, y = _mlp()  # made once: the ranks are threads of one process, sharing torch's random generator

    def rank_run(rank: int, groups: list) -> tuple[list[float], dict[str, torch.Tensor]]:
        pm = parallelize(copy.deepcopy(base), (x,), rank=rank, groups=groups, devices=2, mode=mode)
        return _steps(pm, 3, x, loss_fn=nn.functional.mse_loss, target=y), pm.full_state_dict()

    for losses, params in run_threads(Mesh((2,)), rank_run):
        assert losses == pytest.approx(ref_losses, rel=1e-10)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-10, atol=1e-12)


def _tiled(rank: int, world: int, mode: str, steps: int, path: str) -> tuple[list[float], dict[str, torch.Tensor],
                                                                           list]:
    import soybean

    torch.set_num_threads(1)
    model, inputs = _model()
    pm = soybean.parallelize(model, inputs, devices=world, pipeline=2, microbatches=2, schedule="1f1b", mode=mode)
    losses = _steps(pm, steps, *inputs, loss_fn=lambda out: out)
    sd = pm.full_state_dict()  # every stage's, on every rank
    assert set(sd) == set(model.state_dict())
    pm.save_sharded(path)  # tiles of 2-device stages, on their submeshes
    flat = soybean.parallelize(_model()[0], inputs, devices=world)  # 4 devices, no stages
    flat.load_sharded(path)
    assert all(torch.equal(v, sd[k]) for k, v in flat.full_state_dict().items())
    fresh, _ = _model()
    pm.load_full_state_dict(fresh.state_dict())  # each stage takes its own: back to the start
    assert all(torch.equal(pm.full_state_dict()[k], v) for k, v in fresh.state_dict().items())
    pm.load_full_state_dict(sd)
    return losses, {k: v for k, v in sd.items() if k in dict(model.named_parameters())}, \
        [s["mesh"] for s in (pm.plan.pipeline or {})["stages"]]


def _two_stages_each_tiled_over_two_devices_train_as_serial(got: list) -> None:
    """4 processes: 2 stages of 2 devices, each stage model-parallel (its boundary values sliced in and gathered
    out, their gradients back alike); ``full_state_dict`` gathers every stage's tensors on every rank, and
    ``load_full_state_dict`` loads each stage's own; a sharded checkpoint of the tiled stages loads into a plan
    of 4 devices without stages."""
    ref_losses, ref_params = _serial(2, outside=False)
    params: dict[str, torch.Tensor] = {}
    for losses, p, meshes in got:
        assert losses == pytest.approx(ref_losses, rel=1e-10)
        assert meshes == [[2], [2]]
        params.update(p)
    assert set(params) == set(ref_params)
    for k, v in ref_params.items():
        torch.testing.assert_close(params[k], v, rtol=1e-10, atol=1e-12)


def _interleaved(rank: int, world: int, steps: int, schedule: str,
                 mode: str) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    import soybean

    torch.set_num_threads(1)
    model, inputs = transformer(batch=4, seq=6, hidden=12, layers=4, heads=2)
    model = model.double()
    inputs = tuple(x.double() for x in inputs)
    given = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}  # zero bubble: 2, its default
    pm = soybean.parallelize(model, inputs, devices=world, pipeline=2, microbatches=2, schedule=schedule, mode=mode,
                             **given)
    return _steps(pm, steps, *inputs, loss_fn=lambda out: out), _own(pm, model), pm.plan.pipeline or {}


def _interleaved_schedules_over_two_tiled_groups_train_as_serial(got: list, schedule: str) -> None:
    """4 layers as 4 stages on 2 rank groups of 2 devices (2 virtual stages each): interleaved 1F1B with each stage
    data-parallel (its weights' gradients summed once per step, after every microbatch's backward), and zero
    bubble with each stage model-parallel (its input- and weight-gradient passes apart; the loss a pending sum),
    its 2 virtual stages not given: the interleaved schedules' default."""
    model, inputs = transformer(batch=4, seq=6, hidden=12, layers=4, heads=2)
    model = model.double()
    inputs = tuple(x.double() for x in inputs)
    ref = serial_losses(model, 2, *inputs)
    params: dict[str, torch.Tensor] = {}
    for losses, p, pipe in got:
        assert losses == pytest.approx(ref, rel=1e-10)
        params.update(p)
        assert pipe["virtual_stages"] == 2 and [s["ranks"] for s in pipe["stages"]] == [[0, 1], [2, 3]] * 2
        assert pipe["bubble"] == pytest.approx(1 / ((3 if schedule == "zero-bubble" else 1) * 2 * 2 + 1))
    for k, v in model.named_parameters():
        torch.testing.assert_close(params[k], v.detach(), rtol=1e-10, atol=1e-12)


def _tied_model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = transformer(batch=4, seq=6, hidden=12, layers=4, heads=2, vocab=11)  # head tied to the embedding
    return model.double(), inputs


@contextlib.contextmanager
def _sends_logged() -> Iterator[list[int]]:
    """The bytes of every tensor this rank's pipeline schedule sends (torch's point-to-point batches)."""
    from torch.distributed.pipelining import schedules

    sent: list[int] = []
    real = schedules._batch_p2p

    def logged(ops: list, *args: object, **kwargs: object) -> object:
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real(ops, *args, **kwargs)

    schedules._batch_p2p = logged
    try:
        yield sent
    finally:
        schedules._batch_p2p = real


def _tied(rank: int, world: int, steps: int, path: str) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    import soybean

    torch.set_num_threads(1)
    model, inputs = _tied_model()
    pm = soybean.parallelize(model, inputs, devices=world, pipeline=2, virtual_stages=2, microbatches=2,
                             schedule="zero-bubble")
    losses = _steps(pm, 1, *inputs, loss_fn=lambda out: out)  # the first step also votes on metadata
    with _sends_logged() as sent:
        losses += _steps(pm, steps - 1, *inputs, loss_fn=lambda out: out)
    pipe = pm.plan.pipeline or {}
    mine = [pipe["stages"][i] for i in pm.stage_indices]  # type: ignore[attr-defined]
    priced = [(st["send_bytes"], st["grad_bytes"]) for st in mine]
    assert sum(sent) == (steps - 1) * 2 * sum(  # 2 microbatches a step; the grads of a stage's inputs go back
        f + (pipe["stages"][i - 1]["grad_bytes"] if i else 0) for (f, _), i in zip(priced, pm.stage_indices))
    pm.save_sharded(path)  # the tied weight saved once, by stage 0
    fresh = soybean.parallelize(_tied_model()[0], inputs, devices=world, pipeline=2, virtual_stages=2,
                                microbatches=2, schedule="zero-bubble")
    fresh.load_sharded(path)  # stage 3's copy (on the other rank) takes stage 0's
    pipe["forward"] = float(fresh(*inputs))  # forward only through 4 stages on 2 ranks: the whole batch's loss
    trained = fresh.full_state_dict()
    # AdamW's moments of the tied weight: saved once, and both copies of a fresh module take them
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
    for i in range(2):
        opt.zero_grad()
        pm.train_step(*inputs, loss_fn=lambda out: out)  # type: ignore[operator]
        opt.step()
        if i == 0:
            pm.save_sharded(path, optimizer=opt)
    again = soybean.parallelize(_tied_model()[0], inputs, devices=world, pipeline=2, virtual_stages=2,
                                microbatches=2, schedule="zero-bubble")
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.01)
    again.load_sharded(path, optimizer=opt2)
    opt2.zero_grad()
    again.train_step(*inputs, loss_fn=lambda out: out)
    opt2.step()
    want = pm.full_state_dict()
    for k, v in again.full_state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-12)
    return losses, trained, pipe


def _tied_embeddings_across_stages_under_zero_bubble_train_as_serial(got: list) -> None:
    """A language model whose head is its token embedding, 4 layers as 4 stages on 2 processes under torch's
    zero-bubble schedule: the embedding (stage 0, rank 0) and the head (stage 3, rank 1) each hold a copy of the
    weight, stepped with the sum of both gradients, so both copies stay the serial weight; the integer targets
    cross every stage boundary.  The bytes each rank sends are the priced ones: every stage's boundary values
    forward and the gradients of those autograd tracks back (not the integer targets).  A sharded checkpoint saves
    the weight (and AdamW's moments of it) once and a fresh module's copies both load it: its next step is the
    saving module's."""
    model, inputs = _tied_model()
    ref = serial_losses(model, 3, *inputs)
    after = float(model(*inputs).detach())
    for losses, sd, pipe in got:
        assert losses == pytest.approx(ref, rel=1e-10)
        assert pipe["forward"] == pytest.approx(after, rel=1e-10)
        assert pipe["schedule"] == "zero-bubble" and pipe["bubble"] == pytest.approx(1 / (3 * 2 * 2 + 1))
        assert [(t["stages"], t["bytes"]) for t in pipe["tied"]] == [([0, 3], 11 * 12 * 8)]  # priced once a step
        for k, v in model.state_dict().items():
            torch.testing.assert_close(sd[k], v, rtol=1e-10, atol=1e-12)


LLAMA = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, batch=4, seq=8)


def _llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from soybean import models

    model, inputs = models.load("hf:llama", dict(LLAMA))
    return model.double(), tuple(inputs)


def _llama_pipelined(rank: int, world: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import soybean

    torch.set_num_threads(1)
    model, inputs = _llama()
    pm = soybean.parallelize(model, inputs, devices=world, pipeline=2, microbatches=2)
    return _steps(pm, steps, *inputs, loss_fn=lambda out: out), pm.full_state_dict()


@pytest.mark.dist
def test_a_hugging_face_llama_as_two_stages_trains_as_serial() -> None:
    """transformers' Llama (tiny config; rotary positions made on the CPU in forward, integer labels crossing the
    stage boundary, its loss computed inside) as 2 stages on 2 processes."""
    pytest.importorskip("transformers")
    model, inputs = _llama()
    ref = serial_losses(model, 2, *inputs)
    for losses, sd in spawn(_llama_pipelined, 2, 2, timeout_s=240):
        assert losses == pytest.approx(ref, rel=1e-6)  # the loss upcasts its logits to float32
        for k, v in model.state_dict().items():
            torch.testing.assert_close(sd[k], v, rtol=1e-9, atol=1e-11)


def _checkpoints(rank: int, world: int, path: str) -> None:
    import soybean

    torch.set_num_threads(1)

    def adamw(pm: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(pm.parameters(), lr=0.01)

    def step(pm: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        opt.zero_grad()
        pm.train_step(*inputs, loss_fn=lambda out: out)  # type: ignore[operator]
        opt.step()
        return pm.full_state_dict()  # type: ignore[operator]

    model, inputs = _model()
    pm = soybean.parallelize(model, inputs, devices=world, pipeline=2, microbatches=2)
    opt = adamw(pm)
    step(pm, opt)
    pm.save_sharded(path, optimizer=opt, extra={"step": 1})
    saved, after = pm.full_state_dict(), step(pm, opt)
    plain = soybean.parallelize(_model()[0], inputs, devices=world)  # no stages: DCP reshards the stages' tiles
    opt2 = adamw(plain)
    assert plain.load_sharded(path, optimizer=opt2) == {"step": 1}
    for k, v in plain.full_state_dict().items():
        assert torch.equal(v, saved[k]), k
    for k, v in step(plain, opt2).items():  # the moments came back too: the next step is the pipeline's
        torch.testing.assert_close(v, after[k], rtol=1e-10, atol=1e-12)
    plain.save_sharded(path, optimizer=opt2)
    other = soybean.parallelize(_model()[0], inputs, devices=world, pipeline=2, microbatches=4, schedule="gpipe")
    other.load_sharded(path, optimizer=adamw(other))
    for k, v in other.full_state_dict().items():
        torch.testing.assert_close(v, after[k], rtol=1e-10, atol=1e-12)




def test_3d_baselines_are_torchtitans_layouts_priced_as_pipelines() -> None:
    """torchtitan's PP x FSDP x TP: the degrees it would run (stages of whole TP groups, one sequence per FSDP
    replica per microbatch, at least as many microbatches as stages); each record's step is its slowest rank
    group's microbatches plus the schedule's bubble, and a budget its stages miss turns checkpointing on."""
    from soybean.api import micro_inputs
    from soybean.cost.memory import MEMORY_HEADROOM, budget_bytes
    from soybean.options import PlanOptions
    from soybean.parts import pipeline_baselines
    from soybean.parts.pipeline_plan import bubble_fraction

    assert pipeline_baselines.degrees(64, 16, 8) == [(2, 4, 8), (4, 2, 8), (8, 1, 8), (16, 1, 4)]
    assert pipeline_baselines.degrees(16, 2, 8) == [(2, 1, 8)]  # 2 stages of one node each
    microbatch_counts = pipeline_baselines.microbatch_counts
    assert microbatch_counts(2, 16) == [2, 4, 8, 16] and microbatch_counts(4, 6) == [6]
    model, inputs = transformer(batch=8, seq=16, hidden=32, layers=4, heads=2)

    def capture_at(m: int):
        return capture(model, micro_inputs(inputs, {}, m)[0])

    opts = PlanOptions(devices=8, profile="h100-nvlink-ib", gpus_per_node=4)
    base = pipeline_baselines.price(capture_at, 8, 8, opts)
    for name, v in (("pp_tp_fsdp", 1), ("pp_tp_fsdp_interleaved", 2)):
        rec = base[name]
        s, f, tp = rec["mesh"]
        assert s * f * tp == 8 and rec["microbatches"] in microbatch_counts(s, 8 // f) and rec["stages"] == s * v
        groups = [sum(rec["microbatch_s"][i::s]) for i in range(s)]
        syncs = [sum(rec["sync_s"][i::s]) for i in range(s)]
        bubble = bubble_fraction(rec["schedule"], s, rec["microbatches"], v)
        assert rec["step_time_s"] == pytest.approx(max(groups) * rec["microbatches"] / (1 - bubble) + max(syncs))
        assert "recompute" not in rec
    rec = base["pp_tp_fsdp"]
    gb = rec["memory_bytes"] * 0.99 / 2**30 / (1 - MEMORY_HEADROOM)
    fitted = pipeline_baselines.price(capture_at, 8, 8, replace(opts, memory_gb=gb))["pp_tp_fsdp"]
    assert fitted["memory_bytes"] <= budget_bytes(gb)
    assert fitted.get("recompute") in ("selective", "full") or fitted["mesh"] != rec["mesh"]


def test_best_cut_is_the_least_bottleneck_of_every_cut() -> None:
    """The dynamic programme over the layer chain against every cut, on random stage costs (not additive: a
    range costs what it costs), for every stage count."""
    import itertools
    import random

    from soybean.parts.pipeline_plan import best_cut

    rng = random.Random(0)
    for n in range(1, 8):
        table = {(a, b): rng.random() * (b - a + 1) + rng.random() for a in range(n) for b in range(a, n)}
        for parts in range(1, n + 1):
            bounds, got = best_cut(n, parts, lambda a, b, t=table: t[(a, b)])  # type: ignore[misc]
            best = min(max(table[(a, b)] for a, b in zip((0, *cuts), (*(c - 1 for c in cuts), n - 1)))
                       for cuts in itertools.combinations(range(1, n), parts - 1))
            assert got == pytest.approx(best)
            assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == n - 1
            assert all(b[0] == a[1] + 1 for a, b in zip(bounds, bounds[1:]))
            assert max(table[r] for r in bounds) == pytest.approx(got)
            for lo, hi in ((1, 2), (2, 3), (2, 2)):  # only cuts whose stages hold lo .. hi layers
                bounds, got = best_cut(n, parts, lambda a, b, t=table: t[(a, b)], (lo, hi))  # type: ignore[misc]
                ok = [cuts for cuts in itertools.combinations(range(1, n), parts - 1)
                      if all(lo <= b - a <= hi for a, b in zip((0, *cuts), (*cuts, n)))]
                best = min((max(table[(a, b)] for a, b in zip((0, *cuts), (*(c - 1 for c in cuts), n - 1)))
                            for cuts in ok), default=math.inf)
                assert got == pytest.approx(best)
                if ok:
                    assert all(lo <= b - a + 1 <= hi for a, b in bounds)


AUTO = dict(profile="h100-nvlink-ib", gpus_per_node=1)


def _auto_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from examples.models import mlp

    model, (x, y) = mlp(batch=8, hidden=256, layers=6)
    return model.double(), x.double(), y.double()


def _auto(rank: int, world: int, memory_gb: float) -> tuple[list[float], dict | None, dict[str, torch.Tensor]]:
    import soybean

    torch.set_num_threads(1)
    model, x, y = _auto_mlp()
    pm = soybean.parallelize(model, (x, y), devices=world, pipeline="auto", memory_gb=memory_gb, **AUTO)
    losses = _steps(pm, 2, x, y, loss_fn=lambda out: out)  # the model returns its loss
    return losses, pm.plan.pipeline, _own(pm, model)


def _auto_chooses_stages_only_where_they_are_faster_and_trains_as_serial(got: list, staged: bool) -> None:
    """Two devices on two nodes: with room, no stages (every weight replicated: no communication at all); under
    a tight budget (each weight on one device only), the pipelined plan the search found, faster than any plan
    without stages that fits.  Either way one loop
    (``train_step``) trains as serial does."""
    model, x, y = _auto_mlp()
    ref = serial_losses(model, 2, x, y)
    params: dict[str, torch.Tensor] = {}
    for losses, pipe, p in got:
        assert losses == pytest.approx(ref, rel=1e-10)
        assert (pipe is not None) == staged
        params.update(p)
    if staged:
        pipe = got[0][1]
        chosen = pipe_step(pipe)
        assert min(c["step_time_s"] for c in pipe["searched"] if "step_time_s" in c) == pytest.approx(chosen)
        assert pipe["without_stages_s"] is None or pipe["without_stages_s"] > chosen  # faster than no stages
    for k, v in model.named_parameters():
        torch.testing.assert_close(params[k], v.detach(), rtol=1e-10, atol=1e-12)


def pipe_step(pipe: dict) -> float:
    """The searched candidate the chosen plan is (its schedule, stage count, microbatches and cut)."""
    units = [s["units"] for s in pipe["stages"]]
    return next(c["step_time_s"] for c in pipe["searched"] if "units" in c and c["microbatches"] == pipe["microbatches"]
                and c["units"] == units and c["schedule"] == pipe["schedule"])


def test_the_command_line_searches_stages_with_auto(capsys: pytest.CaptureFixture) -> None:
    from soybean.cli import main

    args = ["plan", "examples.models:mlp", "--arg", "batch=8", "--arg", "hidden=256", "--arg", "layers=6",
            "--devices", "2", "--profile", "h100-nvlink-ib", "--gpus-per-node", "1", "--pipeline", "auto",
            "--format", "json", "--quiet"]
    assert main(args) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert "pipeline" not in roomy and roomy["solver"]["pipelines_searched"]  # searched, not chosen
    searched = roomy["solver"]["pipelines_searched"]  # each slower than no stages, or pruned by its bound
    assert all(c.get("step_time_s", c["bound_s"]) >= roomy["cost"]["step_time_s"] for c in searched)
    assert all(c["bound_s"] <= c["step_time_s"] for c in searched if "step_time_s" in c)  # a bound, never above
    assert main([*args, "--memory-gb", "0.008"]) == 0  # fp32 here: half the float64 test's budget
    tight = json.loads(capsys.readouterr().out)
    pipe = tight["pipeline"]
    assert pipe["searched"] and len(pipe["stages"]) >= 2
    assert {c["schedule"] for c in pipe["searched"]} == {"1f1b", "zero-bubble"}  # and 2 virtual stages each
    assert pipe_step(pipe) == pytest.approx(tight["cost"]["step_time_s"])  # planned whole as it was priced
    assert pipe_step(pipe) == min(c["step_time_s"] for c in pipe["searched"] if "step_time_s" in c)
    assert all(c["bound_s"] <= c["step_time_s"] for c in pipe["searched"] if "step_time_s" in c)
    assert all(c["bound_s"] >= pipe_step(pipe) for c in pipe["searched"] if c.get("pruned"))
    assert set(tight["baselines"]) >= {"tp_fsdp", "pp_tp_fsdp", "pp_tp_fsdp_interleaved"}
    # Under a budget the pipelines go first, and the plan without stages is searched under their best step: none
    # found under it (0.104 ms planned alone), so none is recorded, and the one-mesh baselines are priced anyway.
    assert pipe["without_stages_s"] is None


def test_diff_compares_the_stages() -> None:
    from soybean.options import options as merge
    from soybean.parts.pipeline_plan import plan_pipeline
    from soybean.plan import Plan
    from soybean.report.plandiff import diff

    model, inputs = transformer(batch=4, seq=6, hidden=12, layers=3, heads=2)
    cap = capture(model, tuple(x[:2] for x in inputs))
    opts = merge(None, devices=2)
    a = plan_pipeline(cap, 2, 2, 2, "1f1b", opts)[2]
    b = plan_pipeline(cap, 2, 2, 2, "gpipe", opts, bounds=[(0, 0), (1, 2)])[2]
    assert diff(a, Plan.from_dict(json.loads(a.to_json()))) == []
    lines = diff(a, b)
    assert "pipeline schedule: 1f1b -> gpipe" in lines
    assert any(line.startswith("stage 0 units: ") for line in lines)
    assert any(line.startswith("stage 1 ") and "blocks.2" not in line for line in lines)  # its own plan's lines
    whole = plan_pipeline(cap, 2, 2, 2, "1f1b", opts)[2]
    whole.pipeline = None
    assert diff(a, whole)[-1] == "pipeline: 2 stages -> none"


def _inflight_model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = transformer(batch=8, seq=16, hidden=32, layers=4, heads=2)
    return model.double(), tuple(x.double() for x in inputs)


def _inflight(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], str, float]:
    """Two 1F1B stages of 2 microbatches under a budget the first stage's fastest plan fits with one microbatch's
    activations but not with the two it holds (``test_each_stage_is_planned_with_its_microbatches_in_flight``)."""
    import soybean
    from soybean.api import micro_inputs
    from soybean.cost.memory import MEMORY_HEADROOM
    from soybean.options import PlanOptions
    from soybean.parts.pipeline_plan import stage_plan
    from soybean.parts.stages import even_bounds, layers, split

    torch.set_num_threads(1)
    model, inputs = _inflight_model()
    cap = capture(model, micro_inputs(inputs, {}, 2)[0])
    first = split(cap, even_bounds(len(layers(cap)), 2))[0].cap
    budget = stage_plan(first, 1, PlanOptions(devices=1), 1).memory["peak"]
    pm = soybean.parallelize(model, inputs, devices=world, pipeline=2, microbatches=2, schedule="1f1b",
                             memory_gb=budget / 2**30 / (1 - MEMORY_HEADROOM))
    return _steps(pm, 3, *inputs, loss_fn=lambda out: out), _own(pm, model), pm.plan.to_json(), budget


def _a_stage_recomputing_for_its_microbatches_in_flight_trains_as_serial(got: list) -> None:
    """The first stage reruns both its blocks to hold two microbatches within the budget, and the pipeline trains
    as serial."""
    model, inputs = _inflight_model()
    ref = serial_losses(model, 3, *inputs)
    params: dict[str, torch.Tensor] = {}
    for losses, p, _, _ in got:
        assert losses == pytest.approx(ref, rel=1e-10)
        params.update(p)
    for k, v in model.named_parameters():
        torch.testing.assert_close(params[k], v.detach(), rtol=1e-10, atol=1e-12)
    first = json.loads(got[0][2])["pipeline"]["stages"][0]
    assert first["plan"]["recompute"] == ["blocks.0", "blocks.1"] and first["plan"]["inflight"] == 2
    assert first["memory_bytes"] <= got[0][3]


# ---- on gloo processes: one spawn per world size runs every case in turn (their start-up was most of each run) ----

AUTO_GB = 0.015  # tight for float64 here (test_the_command_line_searches_stages_with_auto: roomy, and fp32 tight)


def _two_process_cases(rank: int, world: int, path: str) -> dict[str, object]:
    """Every 2-process pipeline case, one after another on this process group, each checkpoint in its own
    directory."""
    return {"1f1b": _pipelined(rank, world, "1f1b", 4, False, 3), "outside": _mlp_pipelined(rank, world, 3),
            "tied": _tied(rank, world, 3, f"{path}/tied"), "checkpoints": _checkpoints(rank, world, f"{path}/ckpt"),
            "auto": _auto(rank, world, AUTO_GB), "inflight": _inflight(rank, world)}


@pytest.mark.dist
def test_pipelines_on_two_processes_train_as_serial(tmp_path: Path) -> None:
    """On 2 gloo processes, each case as its function says: two stages under 1F1B (3 layers, uneven: 2 and 1); a
    loss outside the model with its target under GPipe; tied embeddings across 4 stages under zero bubble (the
    bytes sent are the priced ones, the tied weight and its moments checkpointed once); sharded checkpoints
    (weights and AdamW's moments) saved by 2 stages load into a plan without stages, whose next step equals the
    pipeline's, and one saved without stages loads into 2 stages of other microbatches and schedule (checked on
    the ranks); ``pipeline="auto"`` under a tight budget chooses stages, faster than no stages, and trains as
    serial; a stage recomputing to hold its microbatches in flight within the budget trains as serial."""
    got = spawn(_two_process_cases, 2, str(tmp_path), timeout_s=600)
    _two_stages_on_two_processes_train_as_serial([r["1f1b"] for r in got], "1f1b", 4, False)
    _a_loss_outside_the_model_with_its_target_trains_as_serial([r["outside"] for r in got])
    _tied_embeddings_across_stages_under_zero_bubble_train_as_serial([r["tied"] for r in got])
    _auto_chooses_stages_only_where_they_are_faster_and_trains_as_serial([r["auto"] for r in got], staged=True)
    _a_stage_recomputing_for_its_microbatches_in_flight_trains_as_serial([r["inflight"] for r in got])


FOUR = [("tiled", "1f1b", "mp"), ("interleaved", "interleaved-1f1b", "dp"), ("interleaved", "zero-bubble", "mp")]


def _four_process_cases(rank: int, world: int, path: str) -> list[object]:
    """Every 4-process case (``FOUR``: 2 stages or 4 virtual ones over 2 groups of 2 devices), in turn."""
    return [_tiled(rank, world, mode, 2, f"{path}/tiled") if kind == "tiled"
            else _interleaved(rank, world, 2, sched, mode) for kind, sched, mode in FOUR]


@pytest.mark.dist
def test_pipelines_over_two_tiled_groups_on_four_processes_train_as_serial(tmp_path: Path) -> None:
    """On 4 gloo processes: 2 stages each model-parallel over 2 devices (the mesh per stage ``[2]``; the full and
    sharded state round-trips of ``_tiled``), and 4 layers as 4 stages on 2 groups of 2 under interleaved 1F1B with
    each stage data-parallel and under zero bubble with each stage model-parallel (data-parallel tiled stages are
    the interleaved case)."""
    got = spawn(_four_process_cases, 4, str(tmp_path), timeout_s=600)
    for i, (kind, schedule, _) in enumerate(FOUR):
        ranks = [r[i] for r in got]
        if kind == "tiled":
            _two_stages_each_tiled_over_two_devices_train_as_serial(ranks)
        else:
            _interleaved_schedules_over_two_tiled_groups_train_as_serial(ranks, schedule)
