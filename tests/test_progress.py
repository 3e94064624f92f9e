"""The progress line: the planner reports each stage, and the CLI shows it on a terminal only, after
2 s, never with --quiet, never on stdout."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

from examples.models import mlp
from soybean.cli import ProgressLine
from soybean.planner.core import plan

pytestmark = pytest.mark.unit


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_planner_reports_every_stage_in_order() -> None:
    m, inp = mlp(batch=8, hidden=8, layers=1)
    lines: list[str] = []
    plan(m, inp, 4, objective="comm", progress=lines.append)
    assert lines[0] == "capture"
    assert len(lines) == 6
    assert lines[1] == "mesh 4: build and solve" and lines[2].startswith("mesh 4: ") and "gap 0.00%" in lines[2]
    assert lines[3] == "mesh 2x2: build and solve" and lines[4].startswith("mesh 2x2: ")
    assert lines[5:] == ["baselines"]


def test_the_line_shows_only_on_a_terminal_after_the_delay() -> None:
    term = _Terminal()
    with ProgressLine(term, after_s=0.0) as line:
        line("mesh 2x4: build and solve")
        line("baselines")
    out = term.getvalue()
    assert out.count("\r[plan ") == 2 and "baselines" in out and out.endswith("\n")
    for stream, kw in ((_Terminal(), {"enabled": False}), (io.StringIO(), {}), (_Terminal(), {"after_s": 3600.0})):
        with ProgressLine(stream, after_s=kw.get("after_s", 0.0), enabled=kw.get("enabled", True)) as line:
            line("mesh 8: build and solve")
        assert stream.getvalue() == ""


def test_cli_quiet_plans_with_only_the_plan_on_stdout() -> None:
    out = subprocess.run([sys.executable, "-m", "soybean.cli", "plan", "examples.models:mlp", "--devices", "2",
                          "--quiet", "--format", "json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("{") and "[plan" not in out.stdout + out.stderr
