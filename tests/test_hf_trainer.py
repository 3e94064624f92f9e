"""soybean inside ``transformers.Trainer`` and Accelerate (``soybean.hf``): the example scripts as users run them.

The acceptance (docs/guide/hf_trainer.md): ``torchrun --nproc-per-node 2 examples/train_hf_trainer.py`` on two gloo
processes logs the training losses of the same script on one process without soybean (the plain Trainer, the same
global batch; float32, rtol 1e-5) for 20 steps with gradient accumulation 2 and ``max_grad_norm=1.0``, under a
plan that keeps every parameter whole (``--objective time`` at this size) and one that splits parameters
(``--objective comm``); the checkpoint at step 10 loads with ``from_pretrained`` as the serial model holding the
parallel run's parameters; resuming from it reproduces steps 11-20 exactly.  For a tiny Llama, Mixtral (MoE) and
T5 (``Seq2SeqTrainer``).  Each run is a subprocess (``torchrun``), so Trainer's and accelerate's process-wide state
never meets the test process's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="soybean.hf needs the hf extra (transformers): pip install 'soybean[hf]'")
pytest.importorskip("accelerate", reason="soybean.hf needs the hf extra (accelerate): pip install 'soybean[hf]'")

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "examples" / "train_hf_trainer.py"
ACCELERATE = ROOT / "examples" / "train_hf_accelerate.py"
RTOL = 1e-5
STEPS = 20

# Several runs of the Trainer example in one launch (the runs of a test share one process start, the bulk of a tiny
# run's time): each run's flags, where rank 0 writes its log history, and optionally where it writes, at the step-10
# checkpoint, the parameters the tiles hold (gathered from them on every rank): what the checkpoint must load as.
RUNS = '''
import json, sys, torch, transformers
sys.path.insert(0, {root!r})
from examples.train_hf_trainer import build

class Probe(transformers.TrainerCallback):
    def __init__(self, trainer, out):
        self.trainer, self.out = trainer, out

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 10:
            tensors = self.trainer.soybean.pm.full_tensors()
            if self.trainer.is_world_process_zero():
                torch.save({{k: v.clone() for k, v in tensors.items()}}, self.out)

for run in json.load(open(sys.argv[1])):
    trainer, a = build(run["argv"])
    if run.get("probe"):
        trainer.add_callback(Probe(trainer, run["probe"]))
    trainer.train(resume_from_checkpoint=a.resume)
    if trainer.is_world_process_zero():
        json.dump(trainer.state.log_history, open(run["log"], "w"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
'''


def _run(script: Path, nproc: int, *args: str, cwd: Path) -> None:
    """``script`` on ``nproc`` processes (``torchrun --standalone``; one process: plain ``python``), failing the test
    with the tail of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    done = subprocess.run([*launch, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{script.name} {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-4000:]}"


def _losses(path: Path) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of each training log entry of a ``log_history`` JSON."""
    return [(e["step"], e["loss"], e["grad_norm"]) for e in json.loads(path.read_text()) if "loss" in e]


def _assert_close(got: list[tuple[int, float, float]], want: list[tuple[int, float, float]]) -> None:
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == list(range(1, STEPS + 1))
    assert [x for _, x, _ in got] == pytest.approx([x for _, x, _ in want], rel=RTOL)
    assert [g for _, _, g in got] == pytest.approx([g for _, _, g in want], rel=RTOL)


def _split(out: Path) -> int:
    """How many parameters the plan a run wrote (``soybean_plan.json``) splits."""
    from soybean.plan import Plan

    p = Plan.load(out / "soybean_plan.json")
    return sum(1 for f in p.params if any(str(x) != "R" for x in p.param_tiling(f)))


def _runs(nproc: int, runs: list[dict[str, Any]], cwd: Path) -> None:
    """``runs`` (each ``{"argv": [...], "log": path, "probe": path?}``) one after another in one launch of ``nproc``
    processes (``RUNS``)."""
    script, spec = cwd / "runs.py", cwd / "runs.json"
    script.write_text(RUNS.format(root=str(ROOT)))
    spec.write_text(json.dumps(runs))
    _run(script, nproc, str(spec), cwd=cwd)


MODELS = ("llama", "mixtral", "t5")


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list, Path]]:
    """The plain Trainer (``--no-soybean``) on one process, each model, in one launch: model -> (log, output dir)."""
    d = tmp_path_factory.mktemp("serial")
    _runs(1, [{"argv": ["--model", m, "--no-soybean", "--output-dir", str(d / m)], "log": str(d / f"{m}.json")}
              for m in MODELS], d)
    return {m: (_losses(d / f"{m}.json"), d / m) for m in MODELS}


def _two_rank_runs(model: str, d: Path) -> list[dict[str, Any]]:
    """``model``'s runs on two processes, writing under ``d``: ``--objective comm`` with the step-10 probe, its resume
    from that checkpoint, and for Llama ``--objective time`` and ``--contract full``."""
    comm = ["--model", model, "--objective", "comm"]
    d.mkdir(parents=True, exist_ok=True)
    runs = [{"argv": [*comm, "--output-dir", str(d / "out")], "log": str(d / "log.json"),
             "probe": str(d / "params10.pt")},
            {"argv": [*comm, "--output-dir", str(d / "resumed"), "--resume", str(d / "out" / "checkpoint-10")],
             "log": str(d / "resumed.json")}]
    if model == "llama":
        runs.append({"argv": ["--model", model, "--objective", "time", "--output-dir", str(d / "time")],
                     "log": str(d / "time.json")})
        runs.append({"argv": [*comm, "--contract", "full", "--output-dir", str(d / "full")],
                     "log": str(d / "full.json")})
    return runs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every model's runs (``_two_rank_runs``) in one launch of two processes (each launch starts two interpreters
    that import torch, transformers and soybean: most of a tiny run's time): model -> the directory of its runs."""
    d = tmp_path_factory.mktemp("two-ranks")
    _runs(2, [run for m in MODELS for run in _two_rank_runs(m, d / m)], d)
    return {m: d / m for m in MODELS}


@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_split_checkpoint_and_resume_as_one_process(model: str, serial: Any, two_ranks: Any) -> None:
    """On two processes (one launch for every model: ``two_ranks``): ``--objective comm`` (a plan that splits
    parameters) logs every loss and gradient norm of the plain one-process run; its step-10 checkpoint is the serial
    model (``from_pretrained``, the serial model's keys) holding exactly the parameters the tiles held there, with the
    serial optimizer's layout; resuming from it logs steps 11-20 exactly as the uninterrupted run did.  Llama also
    runs ``--objective time`` and ``--contract full`` (each rank's slice all-gathered into the global batch the plan
    reads whole): the same losses.  (The other models' ``time`` plans through the Trainer ran the same Trainer path
    as Llama's, a third of their time: their plans' exactness is ``test_archs``'.)"""
    import transformers as tf

    d = two_ranks[model]
    params, out, ckpt = d / "params10.pt", d / "out", d / "out" / "checkpoint-10"
    want, serial_out = serial[model]
    assert _split(out) > 0, "the comm plan was meant to split parameters"
    run = _losses(d / "log.json")
    _assert_close(run, want)
    if model == "llama":
        _assert_close(_losses(d / "time.json"), want)
        _assert_close(_losses(d / "full.json"), want)

    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()
    auto = tf.AutoModelForSeq2SeqLM if model == "t5" else tf.AutoModelForCausalLM
    loaded = auto.from_pretrained(ckpt).state_dict()
    reference = auto.from_pretrained(serial_out / "checkpoint-10").state_dict()
    assert loaded.keys() == reference.keys()
    tiles = torch.load(params)
    for name, t in tiles.items():
        if name in loaded:
            assert torch.equal(loaded[name], t), name
    named = {n for n, _ in auto.from_pretrained(ckpt).named_parameters(remove_duplicate=False)}
    assert named <= tiles.keys()  # every parameter (tied names too) compared
    mine, theirs = torch.load(ckpt / "optimizer.pt"), torch.load(serial_out / "checkpoint-10" / "optimizer.pt")
    assert mine["param_groups"] == theirs["param_groups"]
    assert {i: {k: tuple(v.shape) for k, v in s.items()} for i, s in mine["state"].items()} == \
        {i: {k: tuple(v.shape) for k, v in s.items()} for i, s in theirs["state"].items()}
    # Steps 1-10 from the checkpoint's state, 11-20 run again: bit for bit.
    assert _losses(d / "resumed.json") == run


def test_accelerate_launch(serial: Any, tmp_path: Path) -> None:
    """``accelerate launch`` (two processes; on a CPU machine accelerate's multi-process launcher is ``--multi_gpu``
    and the script's ``use_cpu`` makes the gloo group): the serial losses."""
    from soybean.runtime.launch import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           str(TRAINER), "--output-dir", str(tmp_path / "out"), "--log-history", str(tmp_path / "log.json")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "soybean: mesh 2," in done.stdout
    _assert_close(_losses(tmp_path / "log.json"), serial["llama"][0])


@pytest.fixture(scope="module")
def plain_loop(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    """The Accelerate example's plain loop (``--no-soybean``) on one process: its losses and norms per step."""
    d = tmp_path_factory.mktemp("plain-loop")
    _run(ACCELERATE, 1, "--no-soybean", "--losses", str(d / "plain.json"), cwd=d)
    return json.loads((d / "plain.json").read_text())


@pytest.mark.parametrize("objective", ["time", "comm"])
def test_accelerate_loop(objective: str, plain_loop: list[dict[str, float]], tmp_path: Path) -> None:
    """The Accelerate pattern (``accelerator.prepare`` then ``SoybeanModel``; ``accumulate``, ``backward``,
    ``clip_grad_norm_``) on two processes: the plain loop's losses and norms on one process."""
    _run(ACCELERATE, 2, "--objective", objective, "--losses", str(tmp_path / "sb.json"), cwd=tmp_path)
    plain, sb = plain_loop, json.loads((tmp_path / "sb.json").read_text())
    assert len(sb) == len(plain) > 0
    assert [e["loss"] for e in sb] == pytest.approx([e["loss"] for e in plain], rel=RTOL)
    assert [e["grad_norm"] for e in sb] == pytest.approx([e["grad_norm"] for e in plain], rel=RTOL)


@pytest.mark.unit
def test_accelerate_only_in_the_hf_extra() -> None:
    import re

    text = (ROOT / "pyproject.toml").read_text()
    lists = dict(re.findall(r'^(\w+) = \[(.*)\]$', text, flags=re.M))
    assert "accelerate" in lists["hf"]
    assert "accelerate" not in lists["dependencies"] and "accelerate" not in lists["test"]


@pytest.mark.unit
def test_unknown_contract() -> None:
    from soybean.hf import SoybeanModel

    with pytest.raises(ValueError, match="unknown contract 'half'"):
        SoybeanModel(torch.nn.Linear(2, 2), contract="half")


@pytest.mark.unit
def test_refuses_label_smoothing(tmp_path: Path) -> None:
    """A loss Trainer computes from the logits is refused by name before anything is planned."""
    import transformers as tf

    from examples.train_hf_trainer import Patterns, tiny_model
    from soybean.hf import Trainer

    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=1, label_smoothing_factor=0.1, report_to="none",
                                use_cpu=True, per_device_train_batch_size=2)
    trainer = Trainer(model=tiny_model("llama"), args=args, train_dataset=Patterns(4, 8, False),
                      data_collator=tf.default_data_collator)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        trainer.train()


@pytest.mark.sim
def test_one_process_model_contract() -> None:
    """``SoybeanModel`` in one process (a simulated group of one): the serial loss and gradient norm, clipping as
    torch clips, the optimizer's state in the serial layout and back, and a batch of another shape refused by name."""
    import transformers as tf

    from examples.train_hf_trainer import Patterns, tiny_model
    from soybean.hf import SoybeanModel

    torch.manual_seed(0)
    model = tiny_model("llama")
    serial = tiny_model("llama")
    serial.load_state_dict(model.state_dict())
    batch = tf.default_data_collator([Patterns(8, 16, False)[i] for i in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sb = SoybeanModel(model, optimizer=opt)
    loss = sb(**batch).loss
    want = serial(**batch).loss
    assert loss.item() == pytest.approx(want.item(), rel=RTOL)
    loss.backward()
    want.backward()
    ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.5)
    assert sb.clip_grad_norm_(0.5).item() == pytest.approx(ref.item(), rel=RTOL)
    assert sb.grad_norm().item() == pytest.approx(0.5, rel=1e-4)  # clipped to max_norm
    opt.step()
    full = sb.optimizer_state_full(opt)
    assert {tuple(s["exp_avg"].shape) for s in full["state"].values()} == {tuple(p.shape) for p in serial.parameters()}
    before = {k: v.clone() for k, v in full["state"][0].items()}
    sb.load_optimizer_state_full(opt, full)
    assert all(torch.equal(before[k], v) for k, v in sb.optimizer_state_full(opt)["state"][0].items())
    assert sb.sync_serial() is model and torch.equal(model.lm_head.weight, sb.full_state_dict()["lm_head.weight"])
    with pytest.raises(ValueError, match="the plan was made for"):
        sb(**{k: v[:2] for k, v in batch.items()})
