"""scripts/check_cuda.py, run here on a CPU with its tiny models (``--small``): the generated program trains like the
eager model in the script's own loop (bit-equal losses in float32 at world size 1), and the script says so."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_cuda.py"
SMALL = ("mlp", "transformer", "gpt2-bf16")


def test_check_cuda_trains_like_eager_on_a_cpu() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--steps", "2", "--timed", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "backend gloo" in run.stdout
    rows = {r[0]: r for line in run.stdout.splitlines() if (r := line.split()) and r[0] in SMALL}
    assert set(rows) == set(SMALL) and all(float(r[2]) == 0.0 for r in rows.values()), run.stdout
