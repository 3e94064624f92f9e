"""The training-step benchmark runs every variant in one spawn and reports every key."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from examples.models import mlp
from soybean.bench.harness import (SOYBEAN_MODES, VARIANTS, BenchConfig, add_parser, auto_rounds, candidates, cmd_bench,
                                   format_table, run_bench, tp_layout, training_state_bytes)
from soybean.cli import build_parser
from soybean.plan import Plan

pytestmark = pytest.mark.unit  # the two runs of the harness are marked dist


def test_tp_layout_follows_a_hugging_face_models_own_tp_plan() -> None:
    """A transformers model's ``base_model_tp_plan``: q, k, v column-wise and o row-wise in every layer (pairing by
    order would split k row-wise, which cannot run); its experts (``packed_colwise``, ``moe_tp_experts``) stay whole."""
    pytest.importorskip("transformers")
    from soybean.models import load

    model, _ = load("hf:mixtral", dict(hidden_size=32, num_hidden_layers=2, vocab_size=64, num_local_experts=2))
    got = tp_layout(model)
    assert got == {f"model.model.layers.{i}.self_attn.{p}": ("rowwise" if p == "o_proj" else "colwise")
                   for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_tp_layout_pairs_linears_and_leaves_an_odd_last_one() -> None:
    even, _ = mlp(batch=2, hidden=8, layers=2)
    assert tp_layout(even) == {"inp": "colwise", "hidden.0": "rowwise", "hidden.1": "colwise", "out": "rowwise"}
    odd, _ = mlp(batch=2, hidden=8, layers=1)
    assert tp_layout(odd) == {"inp": "colwise", "hidden.0": "rowwise"}


def _plan(params: dict) -> Plan:
    return Plan(devices=2, mesh=[2], objective="time", profile="cpu-gloo", fingerprint="f", params=params, inputs={}, nodes={}, cost={})


def test_a_placed_or_pipelined_plan_is_summed_up_by_where_it_runs() -> None:
    """The report's plan line: a placed plan tiles its parameters per region (its own list is empty), so the line
    names its groups and what runs on each; a pipelined plan its stages; a plain one its tilings."""
    from soybean.bench.report import brief_plan

    placed = {"mesh": [2], "params": {}, "stages": 1, "placement_groups": 2,
              "placement": {"regions": [{"units": ["towers.0"], "ranks": [0], "mesh": [1]},
                                        {"units": ["towers.1"], "ranks": [1], "mesh": [1]},
                                        {"units": ["head"], "ranks": [0, 1], "mesh": [2]}]}}
    assert brief_plan(placed) == "2 groups: towers.0 on ranks [0]; towers.1 on ranks [1]; head on ranks [0, 1]"
    piped = {"mesh": [2], "params": {}, "stages": 2, "placement_groups": 1,
             "pipeline": {"schedule": "1f1b", "stages": [{"units": [0, 5], "ranks": [0]}, {"units": [6, 11], "ranks": [1]}]}}
    assert brief_plan(piped) == "2 stages (1f1b): ranks [0]; ranks [1]"
    assert brief_plan({"mesh": [2], "params": {"w": ["S(0)"]}, "stages": 1, "placement_groups": 1}) == "w S(0)"
    assert brief_plan({"mesh": [2], "params": {}, "stages": 1, "placement_groups": 1}) == "no parameters"


def test_candidates_merge_identical_plans() -> None:
    dp, mp = _plan({"w": ["R"]}), _plan({"w": ["S(0)"]})
    dp.inputs = {"x": ["S(0)"]}  # full inputs arrive whole: where they are sliced does not matter
    plans = {"soybean": _plan({"w": ["R"]}), "soybean_dp": dp, "soybean_mp": mp}
    predicted = {"soybean": 1.0, "soybean_dp": 1.0, "soybean_mp": 2.0}
    c = candidates(plans, predicted, {"soybean": 1.2, "soybean_dp": 1.0, "soybean_mp": 1.05})
    assert c["distinct"] == ["soybean", "soybean_mp"] and c["same_plan"] == {"soybean_dp": "soybean"}
    assert c["measured_s"]["soybean"] == pytest.approx(1.1)
    assert c["predicted_fastest"] == "soybean" and c["measured_fastest"] == "soybean_mp"
    # a failed variant (no time) or an unavailable plan (a reason string) is no candidate
    c = candidates({**plans, "soybean_mp": "no plan"}, predicted, {"soybean": None, "soybean_dp": 1.0, "soybean_mp": 1.0})
    assert c["distinct"] == ["soybean_dp"] and c["same_plan"] == {} and c["significance"] is None  # no paired steps given


def test_candidates_judge_the_prediction_on_paired_steps() -> None:
    dp, mp = _plan({"w": ["R"]}), _plan({"w": ["S(0)"]})
    plans = {"soybean": _plan({"w": ["R"]}), "soybean_dp": dp, "soybean_mp": mp}
    predicted = {"soybean": 1.0, "soybean_dp": 1.0, "soybean_mp": 2.0}
    drift = [1.0 + 0.5 * (i % 5) for i in range(12)]  # the machine's speed swings by 3x over the run
    times = {"soybean": [d * 1.00 for d in drift], "soybean_dp": [d * 1.02 for d in drift], "soybean_mp": [d * 1.10 for d in drift]}
    c = candidates(plans, predicted, {v: sum(t) / len(t) for v, t in times.items()}, times)
    sig = c["significance"]
    assert sig["verdict"] == "confirmed" and list(sig["versus"]) == ["soybean_mp"]
    # the twins' steps are averaged step by step: mp against (1.00 + 1.02) / 2 of each step
    assert sig["versus"]["soybean_mp"]["ratio"] == pytest.approx(1.10 / 1.01)
    slower = {**times, "soybean_mp": [d * 0.9 for d in drift]}
    assert candidates(plans, predicted, {v: 1.0 for v in times}, slower)["significance"]["verdict"] == "contradicted"


def test_auto_rounds_alternate_only_what_fits() -> None:
    gib = 1 << 30
    # the wide MLP (268 MB of weights), all six variants on 2 ranks: 4 copies x (2+1+1+2+2+1) replicas
    state = training_state_bytes(268 << 20, ("ddp", "tp", "fsdp", "soybean", "soybean_dp", "soybean_mp"), 2)
    assert state == 4 * (268 << 20) * 9
    assert auto_rounds(state, memory_bytes=24 * gib) == 0   # fits in half of 24 GiB: turns after every step
    assert auto_rounds(state, memory_bytes=16 * gib) == 1   # does not: one after the other
    assert auto_rounds(4 << 20) == 0                        # a 4 MB model on this machine


def test_calibrate_profile_needs_two_devices() -> None:
    with pytest.raises(ValueError, match="needs --devices >= 2"):
        BenchConfig(model="m:f", devices=1, profile="calibrate").validate()
    BenchConfig(model="m:f", devices=2, profile="calibrate").validate()


def test_variants_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown nope"):
        BenchConfig(model="m:f", devices=2, variants=("ddp", "nope")).validate()
    assert BenchConfig(model="m:f", devices=2, variants=("ddp", "soybean")).dist_variants == ("ddp", "soybean")


def test_add_parser_registers_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="cmd"))
    a = ap.parse_args(["bench", "examples.models:mlp", "--devices", "2", "--arg", "hidden=8", "--json"])
    assert a.fn is cmd_bench and a.devices == 2 and a.arg == ["hidden=8"] and a.json and a.steps == 12
    assert a.rounds is None and a.warmup == 3
    # ``soybean bench`` runs the harness's cmd_bench, imported only when it runs
    called = []
    monkeypatch.setattr("soybean.bench.harness.cmd_bench", lambda args: called.append(args) or 0)
    b = build_parser().parse_args(["bench", "examples.models:mlp", "--devices", "2"])
    assert b.fn(b) == 0 and called == [b]


def test_building_the_command_line_imports_no_runtime() -> None:
    """Every ``soybean`` command builds the whole parser: ``bench``'s arguments must not import the harness, whose
    runtime and codegen cost a ``soybean plan`` half a second it never uses."""
    code = ("import sys; from soybean.cli import build_parser; build_parser(); print(sorted(m for m in "
            "('soybean.bench.harness', 'soybean.codegen', 'soybean.runtime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.dist
def test_bench_reports_every_variant() -> None:
    cfg = BenchConfig(model="examples.models:mlp", devices=2, args={"hidden": 32, "batch": 8}, steps=2, warmup=1, timeout_s=120)
    report = run_bench(cfg)
    for key in ("step_s", "predicted_step_s", "plans", "machine", "reasons", "spearman", "speedup_vs_serial", "speedup_vs_ddp"):
        assert key in report, key
    assert set(report["step_s"]) == set(VARIANTS)
    assert set(report["predicted_step_s"]) == set(SOYBEAN_MODES)
    for group in ("step_s", "predicted_step_s"):
        for variant, value in report[group].items():
            if value is None:
                assert report["reasons"].get(variant), f"{group}[{variant}] is null without a reason"
            else:
                assert isinstance(value, float) and value > 0, (group, variant, value)
    assert report["step_s"]["serial"] is not None and report["step_s"]["ddp"] is not None
    plan = report["plans"]["soybean"]
    assert plan["mesh"] == [2] and plan["params"] and plan["stages"] == 1  # no stages: faster without here
    staged = report["plans"]["soybean_pp"]  # forced to 2 stages, trained through train_step
    assert staged["stages"] == 2 and [s["ranks"] for s in staged["pipeline"]["stages"]] == [[0], [1]]
    assert report["step_s"]["soybean_pp"] is not None  # the target passes through soybean's stages
    assert "--loss outside" in report["reasons"]["pp"]  # torch's stages take the target only through loss_fn
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"]
    assert "soybean_dp" in format_table(report)
    assert report["candidates"]["predicted_fastest"] in SOYBEAN_MODES
    assert report["rounds"] == 0  # a small model: the variants took turns
    assert all(len(ts) == 2 for ts in report["step_times_s"].values())
    sig = report["candidates"]["significance"]  # 2 paired steps give no 95% interval
    assert sig is not None and (sig["verdict"] == "unresolved" or not sig["versus"])


@pytest.mark.dist
def test_bench_takes_what_a_hugging_face_causal_lm_returns() -> None:
    """A mixture-of-experts causal LM as transformers returns it (``MoeCausalLMOutputWithPast``): its logits."""
    pytest.importorskip("transformers")
    args = {"raw": True, "batch": 2, "seq": 8, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 1, "num_experts": 2, "num_experts_per_tok": 1, "vocab_size": 64}
    cfg = BenchConfig(model="hf:qwen2_moe", devices=2, args=args, steps=2, warmup=1, timeout_s=180,
                      variants=("serial", "ddp", "soybean"), rounds=1)
    report = run_bench(cfg)
    for v in ("serial", "ddp", "soybean"):
        assert report["step_s"][v], (v, report["reasons"].get(v))
    assert report["first_loss"]["soybean"] == pytest.approx(report["first_loss"]["serial"], rel=1e-4)


@pytest.mark.dist
def test_bench_takes_a_plain_model_returning_logits() -> None:
    """An ``nn.Sequential`` that returns logits: soybean's split output (a ``LazyFull``) is summed on its tiles,
    under the plan that splits the batch and the one that splits the weights, and starts from the serial loss.  Only
    the selected variants run (one round: the in-order and reverse passes); the others are rows saying so."""
    cfg = BenchConfig(model="examples.models:sequential_mlp", devices=2,
                      args={"batch": 16, "hidden": 16, "in_features": 8, "out_features": 4}, steps=2, warmup=1,
                      timeout_s=120, variants=("serial", "soybean", "soybean_mp"), rounds=1)
    report = run_bench(cfg)
    for v in ("soybean", "soybean_mp"):
        assert report["step_s"][v], (v, report["reasons"].get(v))
        assert report["first_loss"][v] == pytest.approx(report["first_loss"]["serial"], rel=1e-5), v
    for v in set(VARIANTS) - {"serial", "soybean", "soybean_mp"}:
        assert report["step_s"][v] is None and "not selected" in report["reasons"][v]
    assert "not selected" in format_table(report) and report["rounds"] == 1


@pytest.mark.dist
def test_bench_computes_the_loss_outside_the_model_in_both_contracts() -> None:
    """``--loss outside``: the step is ``loss = model.loss_fn(model(x), y)`` for every variant; soybean under the
    full-batch contract (a lazily gathered output) and the local-batch one (DDP's) both start from the serial
    loss, and DDP's mean over ranks equals it too (an even split)."""
    cfg = BenchConfig(model="examples.models:mlp", devices=2, args={"hidden": 16, "batch": 8}, steps=2, warmup=1,
                      timeout_s=120, variants=("serial", "ddp", "soybean", "soybean_local"), loss="outside")
    report = run_bench(cfg)
    assert report["loss"] == "outside"
    first = report["first_loss"]
    for v in ("ddp", "soybean", "soybean_local"):
        assert report["step_s"][v], (v, report["reasons"].get(v))
        assert first[v] == pytest.approx(first["serial"], rel=1e-5), v
    assert not report["notes"]
    with pytest.raises(ValueError, match="--loss"):
        BenchConfig(model="m:f", devices=2, loss="sideways").validate()


@pytest.mark.unit
def test_every_variant_is_one_row() -> None:
    """The variants table is the only list: every view the harness reads is derived from it, every row wraps the
    model a known way, soybean's rows are valid planning options, and every loss reference is a variant."""
    from soybean.bench import harness
    from soybean.bench.variants import TABLE
    from soybean.options import PlanOptions

    assert VARIANTS == tuple(v.name for v in TABLE) and set(harness._DIST_PREPARE) == set(VARIANTS) - {"serial"}
    for row in TABLE:
        assert row.contract in ("full", "local") and (row.loss_reference is None or row.loss_reference in VARIANTS)
        if row.soybean:
            PlanOptions(**row.plan)  # raises on a misspelt or invalid option
            assert SOYBEAN_MODES[row.name] == row.plan["mode"]
        else:
            assert not row.plan


@pytest.mark.dist
def test_the_pipeline_variants_train_as_serial_with_the_loss_outside() -> None:
    """torch's hand-split pipeline and soybean's forced 2 stages: both run (their first loss is serial's, or the
    harness nulls them) and report their stages."""
    cfg = BenchConfig(model="examples.models:mlp", devices=2, args={"hidden": 16, "batch": 8, "layers": 4}, steps=2,
                      warmup=1, timeout_s=120, variants=("serial", "pp", "soybean_pp"), loss="outside")
    report = run_bench(cfg)
    assert report["step_s"]["pp"] and report["step_s"]["soybean_pp"], report["reasons"]
    assert report["first_loss"]["pp"] == pytest.approx(report["first_loss"]["serial"], rel=1e-5)
    assert report["plans"]["soybean_pp"]["stages"] == 2
