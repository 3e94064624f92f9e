"""Baselines (``soybean.planner.baselines``): each practitioner layout is what it claims, is a restriction of the
plan's own table (so the plan is never worse on a mesh it searched), says why when it cannot run, and
appears in the JSON and the text report."""
from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from examples.models import transformer
from soybean import models
from soybean.planner import baselines
from soybean.capture.core import capture
from soybean.cli import main
from soybean.cost.memory import MEMORY_HEADROOM
from soybean.cost.profiles import load_profile
from soybean.graph import pinned_use
from soybean.mesh import Mesh
from soybean.planner.core import plan
from soybean.planner.solve import solve_table
from soybean.planner.records import edge_steps
from soybean.report.table import table
from soybean.tiling import Partial, R, Replicate, Shard, fmt

pytestmark = pytest.mark.unit

GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "batch": 4, "seq": 16}


@pytest.fixture(scope="module")
def tcap():
    return capture(*transformer(batch=4, seq=16, hidden=64, layers=2, heads=4))


@pytest.fixture(scope="module")
def gcap():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(*models.load("hf:gpt2", GPT2))


def solved(cap, name: str, devices: int = 4, gpus_per_node: int | None = 2, objective: str = "comm"):
    """A baseline's solved table, and per parameter FQN: (stored tiling, the tilings its consumers read
    it in, the forward collectives on its edges)."""
    lay = baselines.layouts(cap, devices, gpus_per_node)[name]
    g = lay.table(cap, load_profile(None), objective, gpus_per_node)
    r = solve_table(g, objective)
    ch = r.solution.choice
    params: dict[str, tuple] = {}
    for e in g.edges:
        U = g.vars[e.src]
        if U.kind != "param":
            continue
        stored = U.strategies[ch[e.src]].outputs[0]
        uses, steps = params.setdefault(U.fqn, (stored, set(), []))[1:]
        V = g.vars[e.dst]
        steps.extend(str(s).split("[")[0] for s in edge_steps(g, e, r.solution))
        if V.kind == "reshard":  # a shared use: its consumers read the reshard point's tiling
            uses.add(V.strategies[ch[e.dst]].outputs[0])
        else:
            uses.add(V.strategies[ch[e.dst]].inputs[e.dst_in])
    return lay, r, params


def weights(params: dict) -> dict:
    return {k: v for k, v in params.items() if len(v[1]) and k.endswith("weight") and "ln" not in k}


def test_pinned_use_is_as_stored_but_whole_on_gathered_axes_or_a_pending_sum_where_whole() -> None:
    s0, s1 = Shard(0), Shard(1)
    assert pinned_use((s0, s1), (s0, s1), ()) and not pinned_use((s0, s1), (R, s1), ())
    assert pinned_use((s0, s1), (R, s1), (0,)) and not pinned_use((s0, s1), (s0, s1), (0,))
    assert pinned_use((R,), (Partial(),), ())  # to_partial is local: a row-parallel layer's bias
    assert not pinned_use((s0,), (Partial(),), ())


def test_data_parallel_keeps_weights_whole_and_splits_the_batch(tcap) -> None:
    lay, r, params = solved(tcap, "data_parallel")
    assert lay.mesh.shape == (4,)
    for fqn, (stored, uses, steps) in params.items():
        assert stored == (R,) and uses <= {(R,)}, fqn
        assert "all_gather" not in steps, fqn
    assert all(t == [(Shard(0),)] for k, t in lay.domains.items() if k in tcap.inputs)


def test_fsdp_stores_every_parameter_split_and_gathers_it_for_use(tcap, gcap) -> None:
    for cap in (tcap, gcap):
        lay, r, params = solved(cap, "fsdp")
        assert lay.mesh.shape == (4,) and lay.gather == (0,)
        for fqn, (stored, uses, steps) in params.items():
            assert isinstance(stored[0], Shard), (fqn, stored)
            assert uses == {(R,)}, (fqn, uses)  # used whole ...
            assert "all_gather" in steps, (fqn, steps)  # ... gathered on the parameter's own edge
        # The first dim that splits over 4 devices: a [128, 64] embedding on dim 0.
        wte = next(v for k, v in params.items() if k.endswith("wte.weight")) if cap is gcap else None
        assert wte is None or wte[0] == (Shard(0),)


def test_model_parallel_uses_every_weight_where_it_is_stored(tcap) -> None:
    lay, r, params = solved(tcap, "model_parallel")
    for fqn, (stored, uses, _) in weights(params).items():
        assert isinstance(stored[0], Shard) and uses == {stored}, (fqn, stored, uses)


def test_megatron_tp_dp_splits_weights_on_the_tp_axis_inside_a_node(tcap, gcap) -> None:
    for cap in (tcap, gcap):
        lay, r, params = solved(cap, "megatron_tp_dp")
        assert lay.mesh.shape == (2, 2) and lay.gather == ()  # (nodes, gpus per node)
        for fqn, (stored, uses, _) in params.items():
            assert isinstance(stored[0], Replicate), (fqn, stored)  # replicas across nodes
            assert all(pinned_use(stored, u, ()) for u in uses), (fqn, stored, uses)  # used as stored
        for fqn, (stored, _, _) in weights(params).items():
            assert isinstance(stored[1], Shard), (fqn, stored)  # attention and MLP weights split


def test_tp_fsdp_splits_weights_on_the_tp_axis_and_gathers_them_across_nodes(tcap, gcap) -> None:
    for cap in (tcap, gcap):
        lay, r, params = solved(cap, "tp_fsdp")
        assert lay.mesh.shape == (2, 2) and lay.gather == (0,)
        for fqn, (stored, uses, steps) in weights(params).items():
            assert isinstance(stored[0], Shard) and isinstance(stored[1], Shard), (fqn, stored)
            assert stored[0] != stored[1], (fqn, stored)  # FSDP on a dim TP leaves whole
            assert uses == {(R, stored[1])}, (fqn, uses)
            assert "all_gather" in steps, (fqn, steps)


def test_megatron_column_then_row_is_found_at_scale() -> None:
    """Hidden 1,024 on 2 nodes of 4: q/k/v/fc1 split on the output dim, o/fc2 on the input dim."""
    with torch.device("meta"):
        cap = capture(*transformer(batch=8, seq=512, hidden=1024, layers=1, heads=16))
    for name in ("megatron_tp_dp", "tp_fsdp"):
        lay, r, params = solved(cap, name, devices=8, gpus_per_node=4)
        assert lay.mesh.shape == (2, 4)
        tp = {k.removeprefix("blocks.0.").removesuffix(".weight"): fmt((v[0][1],)) for k, v in weights(params).items()}
        assert tp == {"attn.q": "S(0)", "attn.k": "S(0)", "attn.v": "S(0)", "attn.o": "S(1)",
                      "mlp.fc1": "S(0)", "mlp.fc2": "S(1)"}, (name, tp)


@pytest.mark.parametrize("which", ["transformer", "gpt2"])
@pytest.mark.parametrize("objective", ["comm", "time"])
def test_plan_is_never_worse_than_a_baseline_on_a_mesh_it_searched(which, objective, tcap, gcap) -> None:
    cap = tcap if which == "transformer" else gcap
    p = plan(None, (), 4, objective=objective, captured=cap, gpus_per_node=2)
    searched = {tuple(m["mesh"]) for m in p.meshes}
    key = "comm_bytes" if objective == "comm" else "step_time_s"
    assert set(p.baselines) == set(baselines.NAMES + baselines.CP_NAMES)  # both models are causal
    for name, base in p.baselines.items():
        assert "infeasible" not in base, (name, base)  # batch 4 splits over 4 devices and over 2 nodes
        assert tuple(base["mesh"]) in searched
        assert p.cost[key] <= base[key] * (1 + 1e-9) + 1e-12, (name, p.cost, base)


def test_a_batch_too_small_makes_data_parallel_and_fsdp_infeasible_with_the_reason() -> None:
    cap = capture(*transformer(batch=1, seq=8, hidden=16, layers=1, heads=4))
    p = plan(None, (), 4, objective="comm", captured=cap, gpus_per_node=2)
    for name in ("data_parallel", "fsdp", "tp_fsdp", "megatron_tp_dp"):
        base = p.baselines[name]
        assert set(base) == {"infeasible"} and "does not split" in base["infeasible"], (name, base)
    why = p.baselines["fsdp"]["infeasible"]
    assert "a batch of 1" in why and "4 data-parallel" in why, why
    assert "2 data-parallel" in p.baselines["tp_fsdp"]["infeasible"]  # split across 2 nodes only
    assert "comm_bytes" in p.baselines["model_parallel"]  # replicated inputs: model parallelism runs
    # Devices that do not fill whole nodes have no TP x DP mesh.
    p = plan(None, (), 4, objective="comm", captured=cap, gpus_per_node=3, baselines=True)
    assert p.baselines["tp_fsdp"] == {"infeasible": "4 devices do not fill whole nodes of 3"}
    text = table(p)
    for name in baselines.NAMES:
        assert any(line.startswith(name) for line in text.splitlines()), name
    assert "tp_fsdp          infeasible: 4 devices do not fill whole nodes of 3" in text


def test_a_baseline_over_the_memory_budget_is_infeasible_not_a_number() -> None:
    lay = baselines.Layout("fsdp", Mesh((4,)))
    over = SimpleNamespace(comm_bytes=1.0, step_time_s=1.0, memory=2.0 * 2**30)
    # The message names the --memory-gb the layout needs: its modelled peak plus the planner's headroom.
    need = 2.0 / (1 - MEMORY_HEADROOM)
    assert baselines.record(lay, over, budget=1.0 * 2**30) == {
        "infeasible": f"needs {need:.4g} GiB per device (--memory-gb), over the budget"}
    assert baselines.record(lay, over, budget=None)["comm_bytes"] == 1.0
    pinned = SimpleNamespace(comm_bytes=1e30, step_time_s=1e30, memory=0.0)
    assert "infeasible" in baselines.record(lay, pinned, None)


def test_tp_mesh_is_nodes_by_gpus_per_node_else_eight_wide() -> None:
    assert baselines.tp_mesh(16, None)[:3] == (Mesh((2, 8)), 0, 1)
    assert baselines.tp_mesh(4, None)[:3] == (Mesh((4,)), None, 0)  # one node: TP only
    assert baselines.tp_mesh(8, 2)[:3] == (Mesh((4, 2)), 0, 1)
    assert baselines.tp_mesh(4, 1)[:3] == (Mesh((4,)), 0, None)  # one GPU a node: DP only
    assert baselines.tp_mesh(6, 4)[3] == "6 devices do not fill whole nodes of 4"


def test_json_and_cli_table_carry_every_baseline(capsys) -> None:
    args = ["plan", "examples.models:transformer", "--devices", "4", "--gpus-per-node", "2", "--objective", "comm"]
    args += [f"--arg={kv}" for kv in ("batch=4", "seq=8", "hidden=16", "layers=1", "heads=4")]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in baselines.NAMES:
        line = next(x for x in lines if x.startswith(name + " "))
        assert "/device/step" in line and "mesh" in line, line
    assert main(args + ["--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["baselines"]) == set(baselines.NAMES + baselines.CP_NAMES)
    for base in d["baselines"].values():
        assert {"comm_bytes", "step_time_s", "mesh"} <= set(base)


def test_hsdp_shards_inside_a_node_and_replicates_across_nodes(tcap, gcap) -> None:
    """HSDP on (nodes, gpus per node): every parameter split on the node's axis and gathered there for use,
    whole across nodes; the batch split over both; one node has none."""
    for cap in (tcap, gcap):
        lay, r, params = solved(cap, "hsdp")
        assert lay.mesh.shape == (2, 2) and lay.gather == (1,)
        for fqn, (stored, uses, steps) in params.items():
            assert isinstance(stored[0], Replicate) and isinstance(stored[1], Shard), (fqn, stored)
            assert uses == {(R, R)}, (fqn, uses)
            assert "all_gather" in steps, (fqn, steps)
    assert "one node" in baselines.layouts(tcap, 4, None)["hsdp"].infeasible
    assert "one node" in baselines.layouts(tcap, 4, 4)["hsdp"].infeasible


def _least(cap, name: str, devices: int, gpus: int, mode: str | None) -> float:
    """A baseline's modelled peak (bytes) with ``mode`` activation checkpointing (None: none)."""
    lay = baselines.layouts(cap, devices, gpus)[name]
    lay = baselines.checkpointed(lay, cap, mode) if mode else lay
    return solve_table(lay.table(cap, load_profile(None), "time", gpus), "time").memory


def test_baselines_are_made_to_fit_by_checkpointing_as_experts_do() -> None:
    """Under a budget that tp_fsdp misses but fits with full activation checkpointing, its record says it
    recomputed (and what); below even that, infeasible saying so.  Without a budget nothing is checkpointed."""
    cap = capture(*transformer(batch=4, seq=64, hidden=64, layers=4, heads=4))
    none, full = _least(cap, "tp_fsdp", 4, 2, None), _least(cap, "tp_fsdp", 4, 2, "full")
    selective = _least(cap, "tp_fsdp", 4, 2, "selective")
    assert full < selective < none
    budget = (full + selective) / 2  # only full checkpointing fits
    got = baselines.price(cap, 4, load_profile(None), "time", lambda g: solve_table(g, "time"), budget, 2)
    assert got["tp_fsdp"]["recompute"] == "full" and "step_time_s" in got["tp_fsdp"], got["tp_fsdp"]
    assert "recompute" not in got["model_parallel"]  # not one of FITTED
    tight = baselines.price(cap, 4, load_profile(None), "time", lambda g: solve_table(g, "time"), full / 2, 2)
    assert "even with full activation checkpointing" in tight["tp_fsdp"]["infeasible"]
    free = baselines.price(cap, 4, load_profile(None), "time", lambda g: solve_table(g, "time"), None, 2)
    assert not any("recompute" in rec for rec in free.values())


@pytest.mark.parametrize("share", [0.9])
def test_plan_is_never_worse_than_a_feasible_baseline_under_a_budget(share: float | None) -> None:
    """Every feasible baseline, checkpointed or not, is a point of the plan's search space (its mesh a
    factorisation, its recomputation one of ``recompute_choices``): the plan (recompute auto, the default) is never
    slower, at a budget where some layouts fit only checkpointed (``tp_fsdp`` selective, ``megatron_tp_dp`` full);
    without a budget see the test above."""
    from soybean.cost.memory import budget_needed

    cap = capture(*transformer(batch=4, seq=64, hidden=64, layers=4, heads=4))
    none = _least(cap, "tp_fsdp", 4, 2, None)
    gb = budget_needed(none) * share / 2**30
    p = plan(None, (), 4, captured=cap, gpus_per_node=2, memory_gb=gb)
    feasible = {k: v for k, v in p.baselines.items() if "step_time_s" in v}
    assert any("recompute" in v for v in feasible.values()), p.baselines  # some fit only checkpointed
    for name, base in feasible.items():
        assert p.cost["step_time_s"] <= base["step_time_s"] * (1 + 1e-6), (name, p.cost, base)


COHERE2 = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 48, "vocab_size": 96, "sliding_window": 4, "batch": 4, "seq": 8}


@pytest.mark.sim
def test_a_norm_that_casts_its_weight_leaves_data_parallelism_feasible_and_exact() -> None:
    """Cohere's layer norms cast their weight to float32, an op on a weight alone: data parallelism and FSDP price
    it (both were "infeasible": the cast was asked to divide a batch it does not have, splitting a weight they keep
    whole), and a plan forced to data parallelism trains as serial."""
    from soybean.models import hf
    from soybean.verify.sweep import differences, exact_serial
    from soybean.verify.testing import train_parallel_threads, train_serial

    model, inputs = hf.build("cohere2", **COHERE2)
    p = plan(model, inputs, 2, mesh=(2,), profile="h100-nvlink")
    for name in ("data_parallel", "fsdp"):
        assert "infeasible" not in p.baselines[name], p.baselines[name]
    serial = train_serial(model, inputs, steps=2, lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the forced layout cannot run this model" warning either
        par, forced = train_parallel_threads(model, inputs, mesh=(2,), mode="dp", steps=2, lr=1e-3)
    assert all(t == ["R"] for t in forced.params.values())
    bad = differences(serial, exact_serial(model, inputs, serial, steps=2, lr=1e-3), par, lr=1e-3, steps=2)
    assert not bad, "; ".join(bad[:5])


class _Squeezed(torch.nn.Module):
    """A linear layer and a (1, width) bias read through ``squeeze()``, as ERNIE 4.5 MoE's router reads its score
    correction bias."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.bias = torch.nn.Parameter(torch.randn(1, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.lin(x)) + self.bias.squeeze()).square().sum()


@pytest.mark.sim
def test_a_squeezed_weight_splits_and_tensor_parallelism_stores_it_split() -> None:
    """The bias's ``squeeze()`` names its dims (``capture.passes.squeeze_dims``), so the kept dim can be split:
    the tensor-parallel baselines, which store every 2-D weight split, are priced (they were infeasible), and a
    plan forced to store weights where they are used (model parallel) trains on 2 threads as serial."""
    from soybean.verify.sweep import differences, exact_serial
    from soybean.verify.testing import train_parallel_threads, train_serial

    torch.manual_seed(0)
    model, inputs = _Squeezed(), (torch.randn(8, 16),)
    p = plan(model, inputs, 2, mesh=(2,), profile="h100-nvlink")
    for name in ("model_parallel", "megatron_tp_dp"):
        assert "infeasible" not in p.baselines[name], p.baselines[name]
    serial = train_serial(model, inputs, steps=2, lr=1e-3)
    par, forced = train_parallel_threads(model, inputs, mesh=(2,), mode="mp", steps=2, lr=1e-3)
    assert forced.params["bias"] == ["S(1)"], forced.params
    bad = differences(serial, exact_serial(model, inputs, serial, steps=2, lr=1e-3), par, lr=1e-3, steps=2)
    assert not bad, "; ".join(bad[:5])


def test_checkpointed_baselines_share_their_layouts_work_and_price_as_built_alone(tcap, monkeypatch) -> None:
    """Under a budget ``fsdp`` misses, every fitted layout is priced again with selective then full checkpointing:
    those builds of one layout share its ``SharedWork`` (the same object passed to each), and every record equals
    the one each layout's own fresh build gives (sharing is never seen in a figure)."""
    profile, devices = load_profile(None), 4
    fsdp = baselines.layouts(tcap, devices, 2)["fsdp"]
    budget = 0.9 * solve_table(fsdp.table(tcap, profile, "time", 2), "time").memory
    works: list[object] = []
    table = baselines.Layout.table

    def spy(self, *args, **kwargs):
        works.append(args[5] if len(args) > 5 else kwargs.get("work"))
        return table(self, *args, **kwargs)

    def priced():
        return baselines.price(tcap, devices, profile, "time", lambda g: solve_table(g, "time"), budget, 2)

    monkeypatch.setattr(baselines.Layout, "table", spy)
    shared = priced()
    assert any("recompute" in r for r in shared.values())  # the budget made some layout checkpoint to fit
    assert None not in works and len({id(w) for w in works}) < len(works)  # some builds shared one layout's work
    monkeypatch.setattr(baselines.Layout, "same_but_recompute", lambda self, other: False)
    assert priced() == shared
