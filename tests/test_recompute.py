"""Recomputation end to end: planned (``--recompute``), priced, run by the generated program, equal to serial.

A recomputed layer (a block of a repeated stack) keeps only what leaves it; its forward, collectives
included, runs again in backward (``codegen.recompute``, non-reentrant ``torch.utils.checkpoint`` without
early stop).  Training with every layer recomputed equals serial training; every collective that runs,
the reruns included, is one the cost model priced; the modelled activations shrink and the modelled step
grows by the forward pass; ``auto`` decides which layers to recompute with the tilings (exactly, over the
choices it searches), recomputes nothing when everything fits, and is never slower than the memory baselines
(FSDP with full or selective recomputation) under the same budget; measured budgets hold at 2 and 4 ranks.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from examples.models import resnet, transformer
from soybean.capture.core import capture
from soybean.codegen.lower import lower
from soybean.cost.memory import MEMORY_HEADROOM
from soybean.cost.measure_memory import measure_step
from soybean.graph import attention_units, recomputable_layers
from soybean.mesh import Mesh
from soybean.planner.solve import MemoryBudgetError, Search, solve_on
from soybean.planner.recompute import recompute_choices
from soybean.planner.solve import least_memory as planner_least
from soybean.planner.core import plan as make_plan
from soybean.runtime.launch import run_threads
from soybean.verify.testing import compare, train_parallel_threads, train_serial
from tests.test_memory_model import MODELS
from tests.test_priced_is_run import priced, run_one_step

pytestmark = pytest.mark.sim

CASES = [("transformer", (2,), "mp"), ("transformer", (2,), "auto"), ("transformer", (2, 2), "auto"),
         ("gpt2", (2,), "mp"), ("llama", (2,), "dp")]
IDS = [f"{n}-{'x'.join(map(str, m))}-{d}" for n, m, d in CASES]


def _double(name: str) -> tuple[torch.nn.Module, tuple]:
    """A test model in float64: float32's reduction-order differences, which AdamW's normalisation blows up for
    near-zero gradients, would hide a real mismatch behind a loose tolerance (``_trains_like_serial``)."""
    model, inputs = MODELS[name]()
    return model.double(), tuple(x.double() if x.is_floating_point() else x for x in inputs)


def _trains_like_serial(model: torch.nn.Module, inputs: tuple, plan: object) -> list[str]:
    """Two steps of the plan against serial training, to float64's precision (``_double``)."""
    return compare(train_serial(model, inputs, steps=2),
                   train_parallel_threads(model, inputs, plan=plan, steps=2)[0], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name,mesh,mode", CASES, ids=IDS)
def test_recomputed_layers_train_like_serial(name: str, mesh: tuple[int, ...], mode: str) -> None:
    model, inputs = _double(name)
    plan = make_plan(model, inputs, mesh=mesh, mode=mode, baselines=False, recompute="layers")
    assert plan.recompute and all(layer.split(".")[-1].isdigit() for layer in plan.recompute)
    bad = _trains_like_serial(model, inputs, plan)
    assert not bad, "; ".join(bad[:5])


@pytest.mark.parametrize("name,mesh,mode", CASES, ids=IDS)
def test_reruns_are_priced(name: str, mesh: tuple[int, ...], mode: str) -> None:
    """The program runs each recomputed layer's forward collectives twice, and the cost model priced both."""
    model, inputs = MODELS[name]()
    cap = capture(model, inputs)
    plan = make_plan(None, (), captured=cap, mesh=mesh, mode=mode, objective="comm", baselines=False,
                     recompute="layers")
    want, want_sync, comm_bytes = priced(cap, plan)
    assert comm_bytes == pytest.approx(plan.cost["comm_bytes"], rel=1e-5, abs=1e-6)
    ran = Counter(run_one_step(model, inputs, plan, cap))
    assert not Counter(want) - ran, f"priced but not run: {dict(Counter(want) - ran)}"
    extra = ran - Counter(want)
    assert all(kind == "all_reduce" for kind, _, _ in extra), f"run but not priced: {dict(extra)}"


def test_recomputation_trades_time_for_memory() -> None:
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=4, heads=4)
    none = make_plan(model, inputs, mesh=(2,), mode="mp", baselines=False)
    layers = make_plan(model, inputs, mesh=(2,), mode="mp", baselines=False, recompute="layers")
    assert none.recompute == [] and layers.recompute == [f"blocks.{i}" for i in range(4)]
    assert layers.memory["activations"] < 0.5 * none.memory["activations"]
    assert layers.cost["step_time_s"] > none.cost["step_time_s"]
    for p in (none, layers):
        split = 0 if p is none else 4
        gm = lower(capture(model, inputs), p, 0)
        assert sum(type(m).__name__ == "_Recomputed" for m in gm.children()) == split


def test_auto_recomputes_only_when_nothing_fits() -> None:
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=4, heads=4)
    cap = capture(model, inputs)
    kw = dict(captured=cap, mesh=(2,), mode="mp", baselines=False)
    least = {}
    for rec in ("none", "layers"):
        with pytest.raises(MemoryBudgetError) as e:
            make_plan(None, (), memory_gb=1e-6, recompute=rec, **kw)  # type: ignore[arg-type]
        least[rec] = e.value.least
    assert least["layers"] < least["none"]
    between = (least["layers"] + least["none"]) / 2 / 2**30
    assert make_plan(None, (), memory_gb=between, recompute="auto", **kw).recompute  # type: ignore[arg-type]
    assert not make_plan(None, (), memory_gb=10.0, recompute="auto", **kw).recompute  # type: ignore[arg-type]
    # auto is the default; forcing none, the error names the option under which a plan fits (checked, not guessed)
    assert make_plan(None, (), memory_gb=between, **kw).recompute  # type: ignore[arg-type]
    with pytest.raises(MemoryBudgetError, match="it fits with --recompute auto"):
        make_plan(None, (), memory_gb=between, recompute="none", **kw)  # type: ignore[arg-type]
    with pytest.raises(MemoryBudgetError) as e:  # below what every layer recomputed reaches: no such hint
        make_plan(None, (), memory_gb=least["layers"] / 2 / 2**30, recompute="none", **kw)  # type: ignore[arg-type]
    assert "fits with" not in str(e.value)


def test_a_budget_only_bf16_fits_names_the_precision() -> None:
    """An fp32 model whose least memory fits the budget only under bf16-mixed: the error says so."""
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=4, heads=4)
    kw = dict(mesh=(2,), mode="mp", baselines=False)
    with pytest.raises(MemoryBudgetError) as e:
        make_plan(model, inputs, memory_gb=1e-6, precision="bf16-mixed", **kw)  # type: ignore[arg-type]
    half = e.value.least
    with pytest.raises(MemoryBudgetError) as e:
        make_plan(model, inputs, memory_gb=1e-6, **kw)  # type: ignore[arg-type]
    assert half < e.value.least
    budget = (half + e.value.least) / 2 / 2**30
    with pytest.raises(MemoryBudgetError, match="it fits with --precision bf16-mixed"):
        make_plan(model, inputs, memory_gb=budget, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name,mesh,mode", [("transformer", (2,), "mp"), ("gpt2", (2,), "mp"),
                                            ("transformer", (2, 2), "auto")], ids=["transformer-mp", "gpt2-mp", "2x2"])
def test_selective_recomputation_trains_like_serial(name: str, mesh: tuple[int, ...], mode: str) -> None:
    """Only each layer's attention module reruns (a unit below the layer): training still equals serial."""
    model, inputs = _double(name)
    cap = capture(model, inputs)
    plan = make_plan(None, (), captured=cap, mesh=mesh, mode=mode, baselines=False, recompute="attention")
    assert plan.recompute == sorted(attention_units(cap)) and all(u.split(".")[-1] == "attn" for u in plan.recompute)
    gm = lower(cap, plan, 0)
    assert sum(type(m).__name__ == "_Recomputed" for m in gm.children()) == len(plan.recompute)
    bad = _trains_like_serial(model, inputs, plan)
    assert not bad, "; ".join(bad[:5])


def _budgets(cap: object, kw: dict) -> tuple[float, float]:
    """The least memory with no recomputation and with every layer recomputed (bytes)."""
    least = {}
    for rec in ("none", "layers"):
        with pytest.raises(MemoryBudgetError) as e:
            make_plan(None, (), memory_gb=1e-6, recompute=rec, **kw)
        least[rec] = e.value.least
    return least["none"], least["layers"]


def test_auto_is_the_best_recomputation_choice() -> None:
    """At 70% of what the best plan without a budget needs, ``auto`` recomputes some layers but not all (5 of 6:
    cheaper than a tiling that fits without recomputation, cheaper than recomputing all), and its plan is the
    best of every recomputation choice solved on its own or better (the search is exact over its choices, and
    the budget's plans mixed layer by layer, ``tying.mix_layers``, or shifted to another choice may lay layers out
    unlike each other, which one choice's tied solve cannot), and never below the plan's own bound."""
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=6, heads=4)
    cap = capture(model, inputs)
    kw = dict(captured=cap, mesh=(2,), baselines=False)
    budget = 0.7 * make_plan(None, (), **kw).cost["memory_bytes"]  # modelled bytes: memory_gb adds the headroom
    p = make_plan(None, (), memory_gb=budget / (1 - MEMORY_HEADROOM) / 2**30, recompute="auto", **kw)
    assert 0 < len(p.recompute) < 6 and p.cost["memory_bytes"] <= budget * (1 + 1e-9)
    best = float("inf")
    from soybean.cost.profiles import load_profile
    for chain in recompute_choices(cap):
        for units in chain:
            try:
                r = solve_on(cap, Mesh((2,)), Search(load_profile(None), memory_bytes=budget), recompute=units)
            except MemoryBudgetError:
                continue
            best = min(best, r.step_time_s)
    assert p.solver["bound"] * (1 - 1e-9) <= p.cost["step_time_s"] <= best * (1 + 1e-6)
    all_layers = make_plan(None, (), memory_gb=budget / (1 - MEMORY_HEADROOM) / 2**30, recompute="layers", **kw)
    assert p.cost["step_time_s"] < all_layers.cost["step_time_s"]


def test_auto_recomputes_the_attention_of_some_layers_and_trains_like_serial() -> None:
    """At 90% of what the best plan without a budget needs, the cheapest choice reruns the attention of some layers
    and nothing else (``recompute_choices``' chain ``C_k``): ``auto`` finds it, it is faster than every choice that
    reruns whole layers or every attention (each solved on its own), and its program trains like serial."""
    model, inputs = transformer(batch=4, seq=64, hidden=64, layers=6, heads=4)
    model = model.double()  # float64: ``_trains_like_serial``'s tolerance
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    cap = capture(model, inputs)
    att, layers = set(attention_units(cap)), set(recomputable_layers(cap))
    kw = dict(captured=cap, mesh=(2,), baselines=False)
    budget = 0.9 * make_plan(None, (), **kw).cost["memory_bytes"]  # type: ignore[arg-type]
    gb = budget / (1 - MEMORY_HEADROOM) / 2**30
    p = make_plan(None, (), memory_gb=gb, recompute="auto", **kw)  # type: ignore[arg-type]
    chosen = set(p.recompute)
    assert chosen and chosen <= att and len(chosen) < len(att), chosen
    assert p.cost["memory_bytes"] <= budget * (1 + 1e-9)
    from soybean.cost.profiles import load_profile
    others = math.inf  # the best choice that reruns a whole layer or every attention
    for units in (u for chain in recompute_choices(cap) for u in chain if u & layers or att <= u):
        try:
            r = solve_on(cap, Mesh((2,)), Search(load_profile(None), memory_bytes=budget), recompute=units)
        except MemoryBudgetError:
            continue
        others = min(others, r.step_time_s)
    assert p.cost["step_time_s"] < others
    bad = _trains_like_serial(model, inputs, p)
    assert not bad, "; ".join(bad[:5])


def test_auto_never_slower_than_the_memory_baselines() -> None:
    """At budgets from everything-fits down to the least: soybean's plan is never slower than FSDP, FSDP with
    every layer recomputed, or FSDP with attention recomputed, where they fit; the recomputing baselines are
    FSDP's plan plus the rerun (slower, less memory)."""
    model, inputs = transformer(batch=8, seq=64, hidden=64, layers=4, heads=4)
    cap = capture(model, inputs)
    free = make_plan(None, (), captured=cap, devices=2)
    fsdp, full, sel = (free.baselines[b]["step_time_s"] for b in ("fsdp", "fsdp_recompute", "fsdp_selective_recompute"))
    assert fsdp < sel < full
    _, least = _budgets(cap, dict(captured=cap, devices=2, baselines=False))
    fitted = 0
    top = free.cost["memory_bytes"] / (1 - MEMORY_HEADROOM)  # the --memory-gb the unbudgeted plan needs
    for f in (1.0, 0.8, 0.6, 0.4, 0.2, 0.0):
        budget = (least + f * (top - least)) * (1 + 1e-9)
        p = make_plan(None, (), captured=cap, devices=2, memory_gb=budget / 2**30, recompute="auto")
        assert p.cost["memory_bytes"] <= budget * (1 - MEMORY_HEADROOM)
        for b in ("fsdp", "fsdp_recompute", "fsdp_selective_recompute", "data_parallel"):
            if "step_time_s" in p.baselines[b]:
                fitted += 1
                assert p.cost["step_time_s"] <= p.baselines[b]["step_time_s"] * (1 + 1e-9), (f, b)
    assert fitted


def test_a_plan_recomputing_some_layers_trains_like_serial() -> None:
    model, inputs = _double("transformer")
    cap = capture(model, inputs)
    kw = dict(captured=cap, mesh=(2,), baselines=False)
    none, layers = _budgets(cap, kw)
    plan = make_plan(None, (), memory_gb=(layers + 0.5 * (none - layers)) / 2**30, recompute="auto", **kw)
    assert plan.recompute
    bad = _trains_like_serial(model, inputs, plan)
    assert not bad, "; ".join(bad[:5])


def test_layers_that_update_in_place_are_not_recomputed() -> None:
    """ResNet's blocks hold batch norm (running statistics move in place): none is offered."""
    model, inputs = resnet(batch=2, image=32, width=0.125, classes=10)
    assert recomputable_layers(capture(model, inputs)) == []
    model, inputs = transformer(batch=2, seq=8, hidden=16, layers=3, heads=4)
    assert recomputable_layers(capture(model, inputs)) == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("name,mode", [("transformer", "mp"), ("gpt2", "mp"), ("llama", "dp")])
def test_measured_peak_within_10_percent_of_the_model_with_every_layer(name: str, mode: str) -> None:
    """Two ranks as threads, every layer recomputed: the measured peak is within 10% of the modelled one.
    (A transformer under dp measures 15% above its model: not yet modelled, see the README.)"""
    from soybean.api import parallelize

    model, inputs = MODELS[name]()
    cap = capture(model, inputs)
    p = make_plan(None, (), captured=cap, devices=2, mode=mode, baselines=False, recompute="layers")

    def rank_fn(rank: int, groups: list) -> int:
        return measure_step(parallelize(model, inputs, plan=p, rank=rank, groups=groups, captured=cap), inputs).peak

    peak = max(run_threads(Mesh(tuple(p.mesh)), rank_fn))
    assert abs(p.cost["memory_bytes"] - peak) <= 0.10 * peak, (p.cost["memory_bytes"], peak)


def _measure_ranks(rank: int, world: int, runs: list[tuple[str, str]]) -> list[int]:
    """In one gloo process: the measured peak of one training step of each (model, plan JSON) in ``runs``."""
    import json

    import torch

    from soybean.api import parallelize
    from soybean.plan import Plan

    torch.set_num_threads(1)
    peaks = []
    for name, plan_json in runs:
        model, inputs = MODELS[name]()
        peaks.append(measure_step(parallelize(model, inputs, plan=Plan.from_dict(json.loads(plan_json))), inputs).peak)
    return peaks


@pytest.mark.dist
@pytest.mark.parametrize("devices", [2, 4])
def test_a_budget_holds_when_the_plan_runs(devices: int) -> None:
    """GPT-2 and Llama (Hugging Face, small configs) with ``--memory-gb`` halfway between what the best plan
    needs and the least any plan reaches, ``--recompute auto``: every gloo process's measured peak stays within
    the budget (the plan is made to ``1 - MEMORY_HEADROOM`` of it) and the modelled peak is at most 10% below it
    and 15% above."""
    from soybean.runtime.launch import spawn

    runs, plans = [], []
    for name in ("gpt2", "llama"):
        model, inputs = MODELS[name]()
        cap = capture(model, inputs)
        free = make_plan(None, (), captured=cap, devices=devices, baselines=False, collectives="backend")
        _, least = _budgets(cap, dict(captured=cap, devices=devices, baselines=False, collectives="backend"))
        budget = (least + free.cost["memory_bytes"] / (1 - MEMORY_HEADROOM)) / 2
        # A Lagrangian duality gap is closed by the frontier elimination, or, on a table too wide for it or past the
        # time limit, by the joint budgeted ILP, which may run to the limit (per solve): 3 s, as any plan the search
        # returns fits the budget and is the one measured (10 s found the same meshes and recomputation, 1% cheaper,
        # at 2.5x the test's time, before the frontier elimination).
        # The backend's collectives, as when these budgets were set: with soybean's own algorithms the cheaper
        # all-reduce makes a hybrid plan on 4 ranks (MLPs split, attention data-parallel) best, whose measured
        # peak (4.11 MB, within the 4.37 MB budget) is 17% above the model's 3.51 MB -- a memory-model miss of
        # that plan, noted on issue 15, not of the algorithms (the same plan with backend calls peaks alike).
        p = make_plan(None, (), captured=cap, devices=devices, memory_gb=budget / 2**30, baselines=False,
                      recompute="auto", time_limit_s=3.0, collectives="backend")
        assert p.cost["memory_bytes"] <= budget
        runs.append((name, p.to_json()))
        plans.append((name, p, budget))
    peaks = [max(col) for col in zip(*spawn(_measure_ranks, devices, runs, timeout_s=300))]
    for (name, p, budget), peak in zip(plans, peaks):
        assert peak <= budget, (name, peak, budget, p.mesh, p.recompute)
        # The model never under-counts by more than 10%; it may over-count by up to 15%: it sums the loss's
        # backward working set (``graph.backward_transient``) and the last rerun's buffers, two moments of the step
        # (Llama on 2 ranks, data parallel with both layers recomputed: 4.90 MB modelled, 4.35 MB measured; a plan
        # the budget's solve keeps since it holds each variable less its rerun buffer, ``graph.budget_memory``).
        assert -0.10 * peak <= p.cost["memory_bytes"] - peak <= 0.15 * peak, (name, p.cost["memory_bytes"], peak,
                                                                             p.mesh, p.recompute)


def _dropout_ranks(rank: int, world: int, plan_json: str) -> bool:
    """In one gloo process: one step of the plan with and without its layers recomputed, from the same seed."""
    import json

    import torch

    from soybean.api import parallelize
    from soybean.plan import Plan

    torch.set_num_threads(1)
    model, inputs = transformer(batch=4, seq=16, hidden=32, layers=3, heads=4, dropout=0.3)
    plan = Plan.from_dict(json.loads(plan_json))
    grads = []
    for layers in ([], recomputable_layers(capture(model, inputs))):
        plan.recompute = layers
        pm = parallelize(model, inputs, plan=plan)
        torch.manual_seed(1234 + rank)
        pm(*inputs).backward()
        grads.append([p.grad.clone() for p in pm.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads)) and any(g.abs().sum() > 0 for g in grads[1])


@pytest.mark.dist
def test_dropout_draws_the_same_masks_when_a_layer_reruns() -> None:
    """With dropout (p = 0.3), the rerun of a recomputed layer in backward draws the masks of its forward (the
    random state is kept, ``torch.utils.checkpoint``'s ``preserve_rng_state``): the gradients equal those of the
    same plan without recomputation, bit for bit, on each of 2 gloo processes."""
    from soybean.runtime.launch import spawn

    model, inputs = transformer(batch=4, seq=16, hidden=32, layers=3, heads=4, dropout=0.3)
    plan = make_plan(model, inputs, mesh=(2,), mode="mp", baselines=False)
    assert spawn(_dropout_ranks, 2, plan.to_json(), timeout_s=120) == [True, True]


@pytest.mark.parametrize("mesh", [(2, 2)])
def test_the_recomputation_bound_is_below_every_choice(mesh: tuple[int, ...]) -> None:
    """``planner.recompute_bound`` (plain table's time, every-layer-recomputed table's memory, a multiplier) is
    a lower bound of the best plan of every recomputation choice within the budget, at every multiplier."""
    from soybean.cost.profiles import load_profile
    from soybean.planner.recompute import recompute_bound

    model, inputs = transformer(batch=4, seq=32, hidden=32, layers=3, heads=4)
    cap = capture(model, inputs)
    search = Search(load_profile(None))
    chains = recompute_choices(cap)
    plain, least = search.table(cap, Mesh(mesh)), search.table(cap, Mesh(mesh), chains[0][-1])
    budget = (planner_least(plain) + planner_least(least)) / 2
    best = math.inf
    for units in (u for chain in chains for u in chain):
        try:
            best = min(best, solve_on(cap, Mesh(mesh), Search(load_profile(None), memory_bytes=budget),
                                      recompute=units).step_time_s)
        except MemoryBudgetError:
            continue
    assert best < math.inf
    for lam in (0.0, 1e-12, 1e-10, 1e-8, 1e-6):
        bound = recompute_bound(plain, least, "time", budget, lam)
        assert bound is not None and bound <= best * (1 + 1e-9), (lam, bound, best)


def test_a_plan_that_fits_with_every_layer_recomputed_caps_the_recomputation_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``planner.bound_cap``: the plain table's fastest plan, when it fits the budget with every layer recomputed,
    prices (on the plain table) above ``recompute_bound`` at every multiplier, so ``budget_bound`` given that plan
    tries no multiplier when the cut is above that price (none could prune) and prunes as before when the cut is
    below it; a plan that does not fit caps nothing."""
    import soybean.planner.recompute as rc
    from soybean.cost.profiles import load_profile
    from soybean.planner.problem import to_problem
    from soybean.search import Pruned

    model, inputs = transformer(batch=4, seq=32, hidden=32, layers=3, heads=4)
    cap = capture(model, inputs)
    search = Search(load_profile(None))
    chains = recompute_choices(cap)
    plain, least = search.table(cap, Mesh((2, 2))), search.table(cap, Mesh((2, 2)), chains[0][-1])
    x = solve_on(cap, Mesh((2, 2)), search).solution.choice
    q = to_problem(least, "time", 1.0)
    assert q.memory is not None
    fitting = q.memory_of(x)  # the least budget at which x fits with every layer recomputed (the relaxation)
    top = rc.bound_cap(plain, least, "time", fitting * 1.001, x)
    assert top is not None and top == pytest.approx(to_problem(plain, "time").evaluate(x), rel=1e-12)
    assert rc.bound_cap(plain, least, "time", fitting * 0.999, x) is None
    for lam in (0.0, 1e-10, 1e-8, 1e-6, 1e-4):
        bound = rc.recompute_bound(plain, least, "time", fitting * 1.001, lam)
        assert bound is not None and bound <= top * (1 + 1e-12), (lam, bound, top)
    tried = []
    monkeypatch.setattr(rc, "recompute_bound", lambda *a: tried.append(a) or -math.inf)
    assert rc.budget_bound(plain, least, "time", fitting * 1.001, top * 1.001, x) is None and not tried
    assert rc.budget_bound(plain, least, "time", fitting * 1.001, top * 0.999, x) is None and len(tried) == 3
    assert rc.budget_bound(plain, least, "time", fitting * 0.999, top * 1.001, x) is None and len(tried) == 6
    monkeypatch.setattr(rc, "recompute_bound", lambda *a: top * 2)
    assert isinstance(rc.budget_bound(plain, least, "time", fitting * 1.001, top * 0.999, x), Pruned)
