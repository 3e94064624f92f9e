"""Lost ranks and nodes, with the launchers users run (gloo, localhost): ``examples/train_resumable.py`` and
``examples/train_mlp.py`` as their READMEs run them.

- ``torchrun --max-restarts 1``: rank 1 SIGKILLs itself at step 5; torchrun restarts both ranks, the script
  resumes from the checkpoint taken after step 3, and every loss of both attempts equals the serial run's, which
  was never interrupted.
- A dead rank never hangs the others: ``soybean run`` and ``torchrun`` (no restarts) exit non-zero within 60 s
  naming the rank.
- Two torchrun nodes on localhost (c10d rendezvous), ``gpus_per_node=1``: losses equal serial.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from soybean.runtime.launch import free_port

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
RESUMABLE = str(ROOT / "examples" / "train_resumable.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SOYBEAN_RUN = [sys.executable, "-m", "soybean.cli", "run"]


def _run(cmd: list[str], timeout: float = 120.0) -> tuple[int, str, float]:
    """Exit code, stdout and stderr together, and seconds taken."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0


def _losses(path: Path) -> dict[tuple[int, int], float]:
    """(attempt, step) -> loss, as rank 0 logged them."""
    out = {}
    for line in path.read_text().split("\n"):
        if line:
            attempt, step, loss = line.split()
            out[(int(attempt), int(step))] = float(loss)
    return out


def _serial(steps: int) -> dict[int, float]:
    """``train_resumable.py``'s run in this process without soybean or a failure (its model, batches and AdamW):
    step -> loss."""
    import torch
    import torch.nn.functional as F

    from examples.train_resumable import batch, make_model

    model = make_model(48)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {}
    for step in range(steps):
        x, y = batch(step, 16, 32, 10)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out[step] = loss.item()
    return out


def test_elastic_restart_resumes_exactly(tmp_path: Path) -> None:
    """The weights and AdamW's moments are split (``--objective comm``), so the checkpoint holds real tiles.  Every
    loss of both attempts is the uninterrupted serial run's (``_serial``; the script's defaults: hidden 48, batch
    16): a launch of the script that nothing kills would only repeat the first attempt's steps."""
    args = ["--steps", "8", "--every", "2", "--objective", "comm"]
    want = _serial(8)
    code, out, _ = _run([*TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "--master-port",
                         str(free_port()), RESUMABLE, "--dir", str(tmp_path / "b"), "--losses",
                         str(tmp_path / "b.txt"), "--kill-rank", "1", "--kill-step", "5", *args])
    assert code == 0, out
    assert "resumed from" in out and "at step 4" in out, out
    got = _losses(tmp_path / "b.txt")
    assert sorted(s for a, s in got if a == 1) == [4, 5, 6, 7]  # the second attempt starts after the checkpoint
    assert max(s for a, s in got if a == 0) <= 5  # the first died at step 5
    for (attempt, step), loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-6, abs=0), (attempt, step)
    assert len({round(v, 6) for v in want.values()}) > 4  # the losses move: equality means something


@pytest.mark.parametrize("launcher", ["soybean run", "torchrun"])
def test_a_dead_rank_stops_the_job(tmp_path: Path, launcher: str) -> None:
    script = [RESUMABLE, "--dir", str(tmp_path / "c"), "--steps", "6", "--kill-rank", "1", "--kill-step", "2"]
    if launcher == "soybean run":
        cmd = [*SOYBEAN_RUN, "--nproc", "2", *script]
        named = "rank 1 exited with code -9"
    else:
        cmd = [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), *script]
        named = "rank      : 1 (local_rank: 1)"
    code, out, took = _run(cmd, timeout=90)
    assert code != 0 and took < 60, (code, took, out)
    assert named in out and "-9" in out, out


def test_two_nodes_on_localhost(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two",
                               str(ROOT / "examples" / "train_mlp.py"), "--gpus-per-node", "1", "--hidden", "32",
                               "--batch", "8"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    table = next(o for o in outs if "max relative difference" in o)
    worst = float(table.split("max relative difference:")[1].split()[0])
    assert worst < 1e-5, table
