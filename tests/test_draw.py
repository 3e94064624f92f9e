"""``soybean draw``: a plain SVG that parses, one row per layer (every layer named), every parameter's tiling
shown, every collective counted on its module's badge, and the per-device time bar adding up to the step."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import torch

from examples.models import transformer
from soybean.capture.core import capture
from soybean.cli import main
from soybean.report.draw import COMM, layout, svg
from soybean.report.explain import Explanation, explain
from soybean.planner.core import plan

pytestmark = pytest.mark.unit

NS = "{http://www.w3.org/2000/svg}"
LAYERS = 12


@pytest.fixture(scope="module")
def ex() -> Explanation:
    """A 12-layer transformer on 2x2 devices under the comm objective: tiled weights, collectives everywhere."""
    with torch.device("meta"):
        model, inputs = transformer(batch=4, seq=8, hidden=16, layers=LAYERS, heads=4)
    cap = capture(model, inputs)
    return explain(cap, plan(None, captured=cap, devices=4, mesh=(2, 2), objective="comm", baselines=False))


def _visible(el: ET.Element) -> str:
    """A ``<text>``'s own words, without its tooltip."""
    return (el.text or "") + "".join(c.tail or "" for c in el)


def test_svg_parses_and_names_every_layer_once_as_a_row(ex: Explanation) -> None:
    root = ET.fromstring(svg(ex))
    assert root.tag == NS + "svg"
    texts = [_visible(t) for t in root.iter(NS + "text")]
    for i in range(LAYERS):
        assert f"blocks.{i}" in texts, i  # the row label
    bands = [b.name for b in layout(ex)]
    assert [b for b in bands if b.startswith("blocks.")] == [f"blocks.{i}" for i in range(LAYERS)]
    assert len(bands) <= LAYERS + 5  # rows by layer, not one per op
    # One box per module: the layers' rows hold the same modules.
    assert len({len(b.boxes) for b in layout(ex) if b.name.startswith("blocks.")}) == 1


def test_every_parameter_shows_its_tiling_and_every_collective_is_counted(ex: Explanation) -> None:
    root = ET.fromstring(svg(ex))
    tips = {t.text for t in root.iter(NS + "title")}
    for fqn, tiling in ex.plan.params.items():
        assert f"{fqn}: {','.join(tiling)}" in tips, fqn
    # The badges' tooltips list each collective once: as many lines as the rows have collectives.
    badges = [r for r in root.iter(NS + "rect") if r.get("stroke") == COMM and r.get("fill") == "#fde0dd"]
    listed = sum(len(r.find(NS + "title").text.splitlines()) for r in badges)
    assert listed == sum(len(r.collectives) for r in ex.rows) > 0
    # And the badge's count by kind: "AG 2 RS 2" adds up to the module's collectives.
    counted = 0
    for r in badges:
        label = next(_visible(t) for t in root.iter(NS + "text") if t.find(NS + "title") is not None
                     and t.find(NS + "title").text == r.find(NS + "title").text)
        counted += sum(int(n) for n in re.findall(r"\b(\d+)\b", label))
    assert counted == listed


def test_time_bar_adds_up_to_the_step(ex: Explanation) -> None:
    root = ET.fromstring(svg(ex))
    line = next(_visible(t) for t in root.iter(NS + "text") if _visible(t).startswith("compute "))
    r = ex.result
    assert f"compute {r.compute_s * 1e3:.3f} ms" in line
    assert f"step {ex.step_time_s * 1e3:.3f} ms" in line
    assert f"{ex.plan.cost['step_time_s'] * 1e3:.3f} ms" in line


def test_cli_draws_svg_and_html_from_a_saved_plan(tmp_path, capsys) -> None:
    args = ["examples.models:transformer", *(f"--arg={k}={v}" for k, v in
                                             {"batch": 4, "seq": 8, "hidden": 16, "layers": 2, "heads": 4}.items())]
    saved = tmp_path / "plan.json"
    assert main(["plan", *args, "--devices", "4", "--objective", "comm", "--quiet", "--out", str(saved)]) == 0
    capsys.readouterr()
    assert main(["draw", *args, "--plan", str(saved), "--out", str(tmp_path / "plan.svg")]) == 0
    root = ET.parse(tmp_path / "plan.svg").getroot()
    assert {"blocks.0", "blocks.1"} <= {_visible(t) for t in root.iter(NS + "text")}
    assert main(["draw", *args, "--plan", str(saved), "--out", str(tmp_path / "plan.html")]) == 0
    page = (tmp_path / "plan.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg xmlns=" in page
    assert "soybean explain: 4 devices" in page and "total of the " in page
    assert f"wrote {tmp_path / 'plan.html'}" in capsys.readouterr().err


def test_a_long_layer_name_keeps_its_number() -> None:
    """Hugging Face layers (``model.transformer.h.11``) are longer than the label column: the start is cut."""
    from soybean.report.draw import LABEL_W, _fit

    label = _fit("model.transformer.h.11", LABEL_W - 16, 12.5, keep_end=True)
    assert label.endswith("h.11") and label.startswith("\u2026")
