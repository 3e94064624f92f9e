"""The documentation's links resolve, and the README's set-up commands are the ones the project runs.

- Every relative Markdown link in ``README.md`` and ``docs/**/*.md`` names a file that exists, and a ``#fragment``
  names a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens).
- The README's test command is the one ``.ci/run`` runs, and the main job's example exists.
- ``scripts/arch_sweep.py --write-docs`` writes the architecture table the docs link, from saved rows.
- (``dist``) The README's main command trains with a plan that splits tensors, and its losses equal serial.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _links(text: str) -> list[str]:
    """Link targets outside code fences and inline code."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: inline code marks and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", text, re.M):
        a = _anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_anchor_rule() -> None:
    assert _anchor("Against issue 17's targets") == "against-issue-17s-targets"
    assert _anchor("On a GPU: measured against modelled") == "on-a-gpu-measured-against-modelled"
    assert _anchor("`--memory-gb`") == "--memory-gb"
    assert _anchor("Read a plan: explain, draw, diff") == "read-a-plan-explain-draw-diff"


def test_link_parser() -> None:
    text = "[a](x.md) ![img](p.png) `[not](y.md)`\n```\n[no](z.md)\n```\n[b](w.md#h)"
    assert _links(text) == ["x.md", "w.md#h"]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_guide_is_linked_from_the_readme() -> None:
    readme = set(_links((ROOT / "README.md").read_text()))
    index = set(_links((ROOT / "docs" / "guide" / "README.md").read_text()))
    for guide in sorted((ROOT / "docs" / "guide").glob("*.md")):
        if guide.name != "README.md":
            assert f"docs/guide/{guide.name}" in readme, guide.name
            assert guide.name in index, guide.name


def _readme_commands() -> list[str]:
    """The README set-up section's fenced bash commands, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_readme_setup_is_two_commands_ci_runs() -> None:
    main, tests = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f"CI does not run the README's test command {tests!r}"
    assert "pip install torch==2.13.0" in main and any("pip install" in line and "torch==2.13.0" in line
                                                          for line in ci)
    script = shlex.split(main.split("&&")[-1])[1]
    assert (ROOT / script).is_file(), script


def test_readme_is_an_entry() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def _arch_sweep():
    spec = importlib.util.spec_from_file_location("arch_sweep", ROOT / "scripts" / "arch_sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arch_sweep_writes_the_docs_table(tmp_path: Path) -> None:
    rows = [{"architecture": "gpt2", "family": "decoder", "task": "causal-lm",
             "results": {"check": "ok", "time": "ok", "comm": "ok"}, "split": {"time": "0/29", "comm": "17/29"},
             "no_rule": [], "seconds": 30.0},
            {"architecture": "t5", "family": "encoder-decoder", "task": "seq2seq",
             "results": {"check": "ok", "time": "FAIL: 1 differ: loss", "comm": "ok"}, "split": {"comm": "50/51"},
             "no_rule": ["aten.one_hot.default"], "seconds": 90.0}]
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps(rows))
    page = tmp_path / "docs" / "architectures.md"
    page.parent.mkdir()
    code = _arch_sweep().main(["--from-json", str(saved), "--tier", "gloo", "--date", "2026-01-02",
                               "--note", "A note.", "--write-docs", str(page)])
    assert code == 1  # a failing row fails the run, as a sweep does
    text = page.read_text()
    assert "Measured on 2026-01-02: `python scripts/arch_sweep.py --tier gloo`, 2 gloo processes" in text
    assert "the whole run in about 2 minutes" in text and "\nA note.\n" in text
    assert "| gpt2 | decoder | yes | yes (0/29 split) | yes (17/29 split) | none |" in text
    assert "| t5 | encoder-decoder | yes | no | yes (50/51 split) | aten.one_hot.default |" in text
    assert "check: 2 of 2 equal (every strategy exact), time: 1 of 2 equal, comm: 2 of 2 equal." in text
    # the link to the guide is relative to where the page is written
    target = re.search(r"\[the guide\]\(([^)#]+)", text)
    assert target is not None
    assert (page.parent / target.group(1)).resolve() == (ROOT / "docs" / "guide" / "check.md").resolve()


def test_architectures_page_is_the_writers_output() -> None:
    """docs/architectures.md is what ``--write-docs`` writes from its own rows (re-rendered, byte for byte)."""
    page = ROOT / "docs" / "architectures.md"
    text = page.read_text()
    sweep = _arch_sweep()
    rows = []
    for line in text.split("\n| architecture |", 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, family, *cells, no_rule = (c.strip() for c in line.strip("|").split("|"))
        results, split = {}, {}
        for col, cell in zip(("check", "time", "comm"), cells):
            results[col] = "ok" if cell.startswith("yes") else "FAIL"
            m = re.search(r"\((\d+/\d+) split\)", cell)
            if m:
                split[col] = m.group(1)
        rows.append(sweep.sweep.Row(name, family, "", results, split, [] if no_rule == "none" else
                                    no_rule.split(", ")))
    date = re.search(r"Measured on (\S+):", text)
    assert date is not None
    took = re.search(r"the whole run in about (\d+) minutes", text)  # the rows' seconds, summed, as the page says
    if took is not None:
        rows[0].seconds = 60.0 * int(took.group(1))
    note = text.split("\n\n")[3]  # title, comment, how it was measured, the note, the table, the summary
    want = sweep.docs_page(rows, ("check", "time", "comm"), path=str(page), date=date.group(1),
                           command="python scripts/arch_sweep.py --tier gloo", tier="gloo", devices=2, note=note)
    assert want == text
    assert len(rows) == 227


@pytest.mark.dist
def test_readme_main_command_splits_and_equals_serial() -> None:
    """The README's main command (its last step, in this environment) plans split tensors and trains as serial."""
    main, _ = _readme_commands()
    cmd = shlex.split(main.split("&&")[-1])
    assert cmd[0] == "python"
    done = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"^blocks\.0\.mlp\.fc1 +linear +S\(0\)", out, re.M), out
    assert re.search(r"^blocks\.0\.mlp\.fc2 +linear +S\(1\)", out, re.M), out
    assert "all_reduce" in out and re.search(r"^measured +\d", out, re.M), out
    worst = re.search(r"max relative difference: (\S+)", out)
    assert worst is not None and float(worst.group(1)) <= 1e-5, out
