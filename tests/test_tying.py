"""Repeated-layer tying: which layers tie, that tying prices a plan exactly, and that the tied optimum
equals the untied one on models small enough to solve both ways."""
from __future__ import annotations

import random

import numpy as np
import pytest

from soybean import models
from soybean.capture.core import capture
from soybean.cost.profiles import BUILTIN
from soybean.graph import build
from soybean.mesh import Mesh
from soybean.planner.core import plan
from soybean.planner.problem import to_problem
from soybean.planner.repeats import find_repeats
from soybean.search import solve, tie

pytestmark = pytest.mark.unit

LLAMA = {"num_hidden_layers": 5, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 48, "vocab_size": 96, "batch": 2, "seq": 8}
GPT2 = {"n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 96, "batch": 4, "seq": 8}


def _graph(ref: str, args: dict, mesh: tuple[int, ...]):
    model, inputs = models.load(ref, dict(args))
    return build(capture(model, inputs), Mesh(mesh), BUILTIN["h100-nvlink"], objective="time")


@pytest.mark.parametrize("ref, args, layers", [("hf:llama", LLAMA, 5), ("hf:gpt2", GPT2, 4)])
def test_the_middle_layers_tie_and_the_boundary_layers_stay_free(ref: str, args: dict, layers: int) -> None:
    g = _graph(ref, args, (2, 2))
    runs = find_repeats(g)
    assert len(runs) == 1
    r = runs[0]
    # layer 0 reads the embedding and the last layer feeds the final norm: their edges differ
    assert (r.first, r.last) == (1, layers - 2) and len(r.blocks) == layers - 2
    assert len({len(b) for b in r.blocks}) == 1 and len(r.blocks[0]) > 10
    for b in r.blocks:  # the blocks' variables line up: same names but for the layer number
        assert all(g.vars[v].kind == g.vars[w].kind for v, w in zip(r.blocks[0], b))


def test_no_repeats_no_runs() -> None:
    model, inputs = models.load("hf:llama", {**LLAMA, "num_hidden_layers": 2})
    g = build(capture(model, inputs), Mesh((2,)), BUILTIN["h100-nvlink"], objective="time")
    assert find_repeats(g) == []  # two layers: one reads the embedding, one feeds the norm


def test_tied_problem_prices_every_tied_plan_exactly() -> None:
    g = _graph("hf:llama", LLAMA, (2, 2))
    p = to_problem(g, "time")
    q, to = tie(p, find_repeats(g))
    assert q.n < p.n
    rng = random.Random(0)
    for _ in range(5):
        c = [rng.randrange(len(u)) for u in q.unary]
        assert p.evaluate([c[to[v]] for v in range(p.n)]) == pytest.approx(q.evaluate(c), rel=1e-12)


@pytest.mark.parametrize("ref, args, mesh", [("hf:llama", LLAMA, (4,)), ("hf:llama", LLAMA, (2, 2)),
                                             ("hf:gpt2", GPT2, (2, 2)), ("examples.models:transformer", {}, (2, 2))])
def test_tied_optimum_equals_untied(ref: str, args: dict, mesh: tuple[int, ...]) -> None:
    g = _graph(ref, args, mesh)
    p = to_problem(g, "time")
    runs = find_repeats(g)
    untied = solve(p, "ilp", gap=0.0)
    tied = solve(p, "ilp", gap=0.0, runs=runs)
    assert tied.objective == pytest.approx(untied.objective, rel=1e-9)
    assert np.isclose(p.evaluate(tied.choice), tied.objective)


def test_plan_json_says_whether_tying_was_used() -> None:
    model, inputs = models.load("hf:llama", dict(LLAMA))
    tied = plan(model, inputs, 4, mesh=(2, 2), profile="h100-nvlink", baselines=False)
    untied = plan(model, inputs, 4, mesh=(2, 2), profile="h100-nvlink", baselines=False, tie_layers=False)
    assert tied.tying["used"] and tied.tying["runs"] == [{"prefix": "model.model.layers", "layers": [1, 3],
                                                          "count": 3}]
    assert tied.tying["variables"][1] < tied.tying["variables"][0]
    assert untied.tying == {"used": False, "runs": [], "variables": [untied.tying["variables"][0]] * 2}
    assert tied.cost["step_time_s"] == pytest.approx(untied.cost["step_time_s"], rel=1e-4)
    assert '"tying"' in tied.to_json()


# Gemma 2's layers alternate sliding-window and full attention: no two consecutive layers are alike.
GEMMA2 = {"num_hidden_layers": 8, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "intermediate_size": 48, "vocab_size": 96, "sliding_window": 4, "batch": 2, "seq": 8}


def test_alternating_layers_tie_two_by_two_and_the_tied_optimum_is_the_untied_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of two layers (sliding, full) tie where single layers cannot: layers 1-6 as three blocks, the
    first (reading the embedding) and last (feeding the norm) free; the tied optimum equals the untied one."""
    from soybean.planner import repeats

    g = _graph("hf:gemma2", GEMMA2, (2, 2))
    runs = find_repeats(g)
    assert [(r.first, r.last, r.period, len(r.blocks)) for r in runs] == [(1, 6, 2, 3)]
    assert runs[0].record()["period"] == 2
    for b in runs[0].blocks:  # position by position, each block's variables are the first block's kinds
        assert [g.vars[v].kind for v in b] == [g.vars[v].kind for v in runs[0].blocks[0]]
    with monkeypatch.context() as m:
        m.setattr(repeats, "MAX_PERIOD", 1)
        assert sum(len(b) for r in find_repeats(g) for b in r.blocks[1:]) == 0  # single layers: nothing ties
    p = to_problem(g, "time")
    untied = solve(p, "ilp", gap=0.0)
    tied = solve(p, "ilp", gap=0.0, runs=runs)
    assert tied.objective == pytest.approx(untied.objective, rel=1e-9)
    assert np.isclose(p.evaluate(tied.choice), tied.objective)


def test_a_sequential_of_single_ops_is_not_tied_by_period() -> None:
    """VGG's numbered ``features.N`` are single ops (a conv, a relu): blocks of them tied two by two lost to the
    untied plan, so only stacks of whole layers are tied by period (``repeats.MIN_LAYER_VARS``)."""
    g = _graph("examples.models:vgg16", {}, (2, 2))
    assert all(r.period == 1 for r in find_repeats(g))


@pytest.mark.sim
def test_a_plan_tied_by_period_trains_as_serial() -> None:
    """The whole path on the alternating stack: the plan (its layers tied two by two, ``objective="comm"`` so that
    tensors split) trains on 2 threads as the float64 serial run does."""
    from soybean.models import hf
    from soybean.verify.sweep import differences, exact_serial
    from soybean.verify.testing import train_parallel_threads, train_serial

    model, inputs = hf.build("gemma2", **{**GEMMA2, "num_hidden_layers": 6})  # layers 1-4 tied: 2 blocks of 2
    serial = train_serial(model, inputs, steps=2, lr=1e-3)
    par, plan = train_parallel_threads(model, inputs, mesh=(2,), objective="comm", steps=2, lr=1e-3)
    assert [r.get("period") for r in plan.tying["runs"]] == [2]
    assert any(t != ["R"] for t in plan.params.values()), "nothing was split"
    bad = differences(serial, exact_serial(model, inputs, serial, steps=2, lr=1e-3), par, lr=1e-3, steps=2)
    assert not bad, "; ".join(bad[:5])
