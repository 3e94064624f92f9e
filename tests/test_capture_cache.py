"""The capture cache (``soybean.capture.cache``): a stored capture plans and lowers exactly as the capture it was
made from, the command line reads it instead of building and exporting the model, and a key changes with
everything the capture depends on."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from soybean.capture import cache as capture_cache
from soybean.capture.core import capture
from soybean.cli import main
from soybean.codegen.lower import lower
from soybean.planner.core import plan

sys.path.insert(0, str(Path(__file__).parent))
from test_golden_plans import MODELS  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["mlp_uneven", "resnet18", "transformer_lm"])
def test_a_stored_capture_plans_and_lowers_as_the_original(name: str) -> None:
    """Plan JSON and every rank's program equal (views keep sharing their base's storage, so the memory model
    counts the same bytes; the module stack, returned-sum marks and constants survive), and every other field of the
    capture: ``parallelize`` sends rank 0's to the other ranks in this form."""
    model, inputs = MODELS[name]()
    cap = capture(model, inputs)
    cap = dataclasses.replace(cap, grad_inputs=frozenset(cap.inputs[:1]))  # as a piece's capture holds them
    again = capture_cache.loads(capture_cache.dumps(cap))
    for f in dataclasses.fields(cap):  # every field but the graph (compared by what it plans and lowers to)
        if f.name not in ("graph_module", "constants"):
            assert getattr(again, f.name) == getattr(cap, f.name), f.name
    assert again.constants.keys() == cap.constants.keys()
    assert all(again.constants[k].equal(v) for k, v in cap.constants.items())
    a, b = (plan(None, (), 4, captured=c, baselines=False) for c in (cap, again))
    da, db = json.loads(a.to_json()), json.loads(b.to_json())
    da["solver"]["seconds"] = db["solver"]["seconds"] = 0.0
    assert da == db
    for r in range(4):
        assert lower(cap, a, r).code == lower(again, b, r).code


def test_the_command_line_reads_the_cache_and_no_cache_skips_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("SOYBEAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SOYBEAN_NO_CACHE", "0")
    args = ["plan", "examples.models:mlp", "--devices", "2", "--arg", "batch=8", "--arg", "hidden=8",
            "--format", "json", "--quiet"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    stored = list((tmp_path / "captures").glob("*.pt"))
    assert len(stored) == 1
    from soybean import models

    def no_build(*a: object, **k: object) -> None:
        raise AssertionError("the model was built although its capture is cached")

    monkeypatch.setattr(models, "load", no_build)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    first["solver"]["seconds"] = second["solver"]["seconds"] = 0.0
    assert first == second
    with pytest.raises(AssertionError, match="the model was built"):
        main(args + ["--no-cache"])
    stored[0].write_bytes(b"not a capture")  # unreadable: dropped, captured afresh
    monkeypatch.undo()
    monkeypatch.setenv("SOYBEAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SOYBEAN_NO_CACHE", "0")
    assert main(args) == 0 and capsys.readouterr().out
    assert capture_cache.load(stored[0].stem) is not None


def test_the_key_changes_with_what_the_capture_depends_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = capture_cache.capture_key("examples.models:mlp", {"batch": 8}, "fp32")
    assert base == capture_cache.capture_key("examples.models:mlp", {"batch": 8}, "fp32")
    assert base != capture_cache.capture_key("examples.models:mlp", {"batch": 16}, "fp32")
    assert base != capture_cache.capture_key("examples.models:mlp", {"batch": 8}, "bf16-mixed")
    assert base != capture_cache.capture_key("examples.models:transformer", {"batch": 8}, "fp32")
    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    one = capture_cache.capture_key(f"{f}:fn", {}, "fp32")
    f.write_text("x = 2\n")
    two = capture_cache.capture_key(f"{f}:fn", {}, "fp32")
    assert one != two  # the model's code changed
    # soybean's own code changed (its version string did not): a user's model is captured again
    monkeypatch.setattr(capture_cache, "code_digest", lambda: "another soybean")
    assert capture_cache.capture_key(f"{f}:fn", {}, "fp32") != two
