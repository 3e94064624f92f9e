"""Routed experts (mixture of experts, issue 22): the capture pass that finds them by their dataflow, the fused op
under every strategy of its rule (tokens split, experts split with rows moved by all-to-all, experts split with a
pending sum) against the serial op, the row moves' adjoint, the plan's ``moe`` record and its pricing, and
training equal to serial with the experts split."""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from soybean.capture.core import Captured, capture
from soybean.capture.passes import PASSES
from soybean.ir.experts import OP, routed_experts
from soybean.mesh import Mesh
from soybean.models import archs
from soybean.rules import expand, make_opspec
from soybean.runtime import run_threads
from soybean.runtime.collectives import move_rows
from soybean.tiling import Shard
from soybean.verify.validate import check_op

pytestmark = pytest.mark.unit

MOE = ("mixtral", "deepseek_v3", "gpt_oss")  # gated, with shared experts and dense layers, with biases and clamps


@functools.cache
def tiny(name: str) -> tuple[torch.nn.Module, dict]:
    arch = next(a for a in archs.ARCHS if a.name == name)
    model, inputs = archs.build(arch)
    return model.double(), inputs


def _fused(cap: Captured) -> list[torch.fx.Node]:
    return [n for n in cap.graph.nodes if n.target is OP]


def _run(cap: Captured, model: torch.nn.Module, inputs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The captured graph on ``model``'s own tensors: its floating outputs and, after backward of their sum, the
    gradients of the parameters it reads."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers()), **cap.constants}
    params = [state[cap.params[n.name]] for n in cap.graph.nodes if n.op == "placeholder" and n.name in cap.params]
    flat = cap.feed(state)
    outs = [t for t in torch.utils._pytree.tree_leaves(cap.graph_module(*flat, *inputs.values()))
            if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for p in params:
        p.grad = None
    sum(o.sum() for o in outs).backward()
    return [o.detach() for o in outs], [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


@pytest.mark.parametrize("name", MOE)
def test_the_fused_op_computes_what_the_region_did(name: str) -> None:
    """Each MoE layer of the model (transformers' grouped-matmul experts) becomes one op; the graph's outputs
    and every parameter's gradient are those of the graph without the pass."""
    model, inputs = tiny(name)
    fused = capture(model, inputs)
    plain = capture(model, inputs, passes=tuple(p for p in PASSES if p.name != "fuse_routed_experts"))
    layers = sum(1 for m in model.modules() if hasattr(m, "gate_up_proj") or hasattr(m, "down_proj")
                 and getattr(m, "down_proj", None) is not None and isinstance(m.down_proj, torch.nn.Parameter))
    assert len(_fused(fused)) == layers > 0 and not _fused(plain)
    got, want = _run(fused, model, inputs), _run(plain, model, inputs)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_region_with_an_unknown_step_is_left_alone() -> None:
    """A body step the fused op cannot compute row by row (here a sum over the rows) keeps the region as it was,
    and so does an unsorting that is not the sort's inverse: the pass fuses only what it can prove token-wise."""
    from soybean.capture.passes import fuse_routed_experts as experts

    model, inputs = tiny("mixtral")
    cap = capture(model, inputs, passes=tuple(p for p in PASSES if p.name != "fuse_routed_experts"))
    gm = cap.graph_module
    mm = next(n for n in gm.graph.nodes if "grouped_mm" in str(n.target))
    with gm.graph.inserting_after(mm):
        total = gm.graph.call_function(torch.ops.aten.sum.dim_IntList, (mm, [0], True))
        mixed = gm.graph.call_function(torch.ops.aten.add.Tensor, (mm, total))
    total.meta["val"] = mm.meta["val"].sum(0, keepdim=True)
    mixed.meta["val"] = mm.meta["val"]
    mm.replace_all_uses_with(mixed, delete_user_cb=lambda u: u is not total and u is not mixed)
    assert len(experts.find(gm)) == 1  # the other layer still fuses
    # ... and one whose unsorting is not the inverse permutation (positions from 1) is not fused either
    ar = [n for n in gm.graph.nodes if n.target is torch.ops.aten.arange.default and n.args[0] == 2 * 9 * 2][-1]
    ar.target, ar.args = torch.ops.aten.arange.start, (1, ar.args[0] + 1)
    assert experts.find(gm) == []


def _body_case(tokens: int, experts: int) -> tuple:
    """Arguments of the op with the tiny Mixtral's body and ``experts`` experts, routing skewed so that most rows
    go to the first two experts (members holding the others receive few rows or none)."""
    model, inputs = tiny("mixtral")
    node = _fused(capture(model, inputs))[0]
    body = node.args[5]
    w1, w2 = (n.meta["val"] for n in node.args[3])
    gen = torch.Generator().manual_seed(3)
    h = w1.shape[-1]
    x = torch.randn(tokens, h, dtype=torch.float64, generator=gen)
    idx = torch.randint(0, 2, (tokens, 2), generator=gen)
    idx[:, 1] = (idx[:, 0] + 1) % 2
    idx[-1, 1] = experts - 1
    w = torch.rand(tokens, 2, dtype=torch.float64, generator=gen)
    params = [torch.randn(experts, *w1.shape[1:], dtype=torch.float64, generator=gen) / 4,
              torch.randn(experts, *w2.shape[1:], dtype=torch.float64, generator=gen) / 4]
    return x, idx, w, params, experts, body


@pytest.mark.parametrize("shape", [(1,), (2,), (4,), (2, 2)])
def test_every_strategy_equals_the_serial_op(shape: tuple[int, ...]) -> None:
    """Forward and every input's gradient, tile by tile, under every strategy the rule lists on the mesh:
    uneven tokens (5; 7 over 4 members: 2, 2, 2, 1) and experts (3; 7 over 4), rows for some members only."""
    four = math.prod(shape) == 4
    args = _body_case(tokens=7 if four else 5, experts=7 if four else 3)
    n = check_op(OP, args, mesh=Mesh(shape), rtol=1e-10, atol=1e-10)
    assert n >= (1 if shape == (1,) else 4)


def test_the_rule_lists_dispatch_and_pending_sum() -> None:
    """On one axis: tokens split, experts split with the tokens (rows moved), experts split alone (``P``), and
    every expert split inside along its FFN dim (``P``): the packed gate and up weight stored as pairs
    ``(experts, 2, f, h)`` split along ``f``, the down projection along its ``f``."""
    args = _body_case(tokens=6, experts=4)
    op = make_opspec(OP, args, {}, routed_experts(*args))
    got = {(str(s.inputs[0][0]), str(s.inputs[3][0]), str(s.inputs[4][0]), str(s.outputs[0][0]))
           for s in expand(op, Mesh((2,)))}
    assert got == {("R", "R", "R", "R"), ("S(0)", "R", "R", "S(0)"), ("S(0)", "S(0)", "S(0)", "S(0)"),
                   ("R", "S(0)", "S(0)", "P"), ("R", "S(2)", "S(2)", "P")}


def test_the_op_is_priced_at_every_row_through_its_experts_matmuls() -> None:
    """Forward FLOPs: each of the ``T k`` rows through its expert's gate and up (``2 h 2f``) and down (``2 f h``)
    products; the routing weights ``w`` are no expert weight."""
    from soybean.cost.compute import flops

    args = _body_case(tokens=6, experts=4)
    op = make_opspec(OP, args, {}, routed_experts(*args))
    (_, two, f, h), k = args[3][0].shape, args[1].shape[1]
    assert flops(op)[0] == 6 * k * (2 * h * two * f + 2 * f * h)


def test_tensor_parallelism_inside_the_experts_is_offered_only_where_the_body_proves_it() -> None:
    """``ffn_split`` proves the FFN split by propagation over the body: Mixtral's packed gate and up (stored as
    pairs) then down splits; a bias added after the down projection (GPT-OSS) would be summed once per rank, so
    there is no proof, and neither is there for the packed weight read without its pairs (a contiguous split of
    ``2 f`` rows would give one rank all the gate's rows)."""
    from soybean.rules.experts import ffn_split

    x, idx, w, params, experts, body = _body_case(tokens=6, experts=4)
    shapes = tuple(tuple(p.shape) for p in params)
    assert ffn_split(body, shapes) == ((2, True), (2, False))
    unpacked = body.replace('["aten::flatten.using_ints",[{"ref":3},1,2],{}]', '["aten::clone.default",[{"ref":3}],{}]')
    assert unpacked != body and ffn_split(unpacked, ((4, 256, 64), shapes[1])) is None
    oss = _fused(capture(*archs.build(next(a for a in archs.ARCHS if a.name == "gpt_oss"))))[0]
    ws = tuple(tuple(v.meta["val"].shape) for v in oss.args[3])
    assert ffn_split(oss.args[5], ws) is None


@pytest.mark.parametrize("members", [2, 3])
def test_moving_rows_is_adjoint_to_moving_them_back(members: int) -> None:
    """``<M x, y> = <x, M* y>`` summed over members, with blocks of every size (empty ones included)."""
    gen = torch.Generator().manual_seed(members)
    send = torch.randint(0, 4, (members, members), generator=gen).tolist()  # send[j][k]: rows j sends k
    xs = [torch.randn(sum(send[j]), 3, dtype=torch.float64, generator=gen) for j in range(members)]
    ys = [torch.randn(sum(send[j][k] for j in range(members)), 3, dtype=torch.float64, generator=gen)
          for k in range(members)]

    def member(rank: int, groups: list) -> tuple[torch.Tensor, float, float]:
        (g,) = groups
        recv = tuple(send[j][rank] for j in range(members))
        x = xs[rank].clone().requires_grad_(True)
        moved = move_rows(x, g, tuple(send[rank]), recv)
        moved.backward(ys[rank])
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        return moved.detach(), float((moved.detach() * ys[rank]).sum()), float((x.detach() * grad).sum())

    got = run_threads(Mesh((members,)), member)
    lhs, rhs = sum(a for _, a, _ in got), sum(b for _, _, b in got)
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))
    for k, (moved, _, _) in enumerate(got):  # member k: every member's block for k, in member order
        blocks = [xs[j][sum(send[j][:k]):sum(send[j][:k + 1])] for j in range(members)]
        assert torch.equal(moved, torch.cat(blocks))


def test_the_plan_records_each_moe_layer_and_prices_its_all_to_alls() -> None:
    """The ``moe`` record names each layer's experts, the axes splitting them and the degree; a strategy moving
    rows is priced with two all-to-alls forward and two backward of the local rows, and the count exchange."""
    from soybean.cost.collectives import op_comm_calls
    from soybean.planner.core import plan

    model, inputs = tiny("mixtral")
    p = plan(model, inputs, 2, baselines=False)
    assert [r["layer"] for r in p.moe] == ["model.layers.0", "model.layers.1"]
    assert all(r["experts"] == 4 and r["top_k"] == 2 and r["degree"] == 2 ** len(r["axes"]) for r in p.moe)
    assert "moe" in p.to_dict()
    args = _body_case(tokens=6, experts=4)
    op = make_opspec(OP, args, {}, routed_experts(*args))
    mesh = Mesh((2,))
    st = next(s for s in expand(op, mesh) if isinstance(s.inputs[0][0], Shard) and isinstance(s.inputs[3][0], Shard))
    calls = op_comm_calls(op, st, [True, False, True, True, True], mesh)
    rows = 3 * 2 * args[0].shape[1] * 8  # my 3 tokens x top-2 rows x hidden x float64
    assert [c[:4] for c in calls] == [("all_to_all", 0, 16.0, 1), ("all_to_all", 0, rows, 1), ("all_to_all", 0, 3 * 2 * 8.0, 1),
                     ("all_to_all", 0, rows, 1), ("all_to_all", 0, rows, 1), ("all_to_all", 0, rows, 1)]


@pytest.mark.sim
@pytest.mark.parametrize("name, mesh, mode", [("mixtral", (2,), "auto"), ("mixtral", (2, 2), "auto"),
                                              ("deepseek_v3", (2, 2), "mp")])
def test_training_with_the_experts_split_equals_serial(name: str, mesh: tuple[int, ...], mode: str) -> None:
    """A tiny MoE trained for a few AdamW steps with every rank a thread, under the plan that minimises
    communication (its experts split: rows moved on one axis, on a 2x2 mesh a pending sum on the other for Mixtral,
    rows moved on both for DeepSeek-V3): every loss, gradient and parameter as serial."""
    from soybean.planner.core import plan
    from soybean.verify.sweep import LR, STEPS, differences, exact_serial
    from soybean.verify.testing import train_parallel_threads, train_serial

    model, inputs = archs.build(next(a for a in archs.ARCHS if a.name == name))  # float32, as transformers runs it
    cap = capture(model, inputs)
    p = plan(None, (), captured=cap, devices=math.prod(mesh), mesh=mesh, mode=mode, objective="comm",
             baselines=False)
    assert p.moe and all(r["dispatch"] for r in p.moe) and all(r["degree"] == math.prod(mesh) for r in p.moe)
    if len(mesh) > 1 and name == "mixtral":  # (DeepSeek-V3's, with its loss split by class, moves rows on both)
        assert all(r["partial"] for r in p.moe)
    serial = train_serial(model, inputs, steps=STEPS, lr=LR)
    par, _ = train_parallel_threads(model, inputs, plan=p, steps=STEPS, lr=LR)
    assert not differences(serial, exact_serial(model, inputs, serial), par)  # judged against the float64 run


def _ffn_split_plan(name: str, mesh: tuple[int, ...]) -> tuple[torch.nn.Module, dict, object]:
    """A tiny MoE's plan with every expert weight stored split along its FFN dim on mesh axis 0 (and by expert on
    axis 1 of a 2-D mesh), the rest chosen by the planner: tensor parallelism inside the experts, forced."""
    from soybean.cost.profiles import load_profile
    from soybean.graph.build import build
    from soybean.options import PlanOptions
    from soybean.planner import baselines, solve as planner
    from soybean.planner.core import to_plan

    model, inputs = archs.build(next(a for a in archs.ARCHS if a.name == name))  # float32, as transformers runs it
    cap = capture(model, inputs)
    m = Mesh(mesh)
    search = planner.Search(load_profile("cpu-gloo"))
    inside = (Shard(2), Shard(0))[:len(mesh)]
    doms = {f: [inside] for f in baselines.expert_weights(cap)}
    g = build(cap, m, search.on_mesh(m), domains=doms, pin_params=True, pricing=search.run.pricing)
    r = planner.solve_table_on(g, search)
    return model, inputs, to_plan(cap, r, PlanOptions(devices=m.size), "cpu-gloo", {}, 0.0, [r])


@pytest.mark.sim
@pytest.mark.parametrize("name, mesh", [("mixtral", (2,)), ("deepseek_v3", (2,)), ("mixtral", (2, 2))])
def test_training_with_the_experts_split_inside_equals_serial(name: str, mesh: tuple[int, ...]) -> None:
    """Tensor parallelism inside the experts: the packed gate and up weight split along its pairs' FFN dim, the down
    projection along its FFN dim, the output a pending sum; on a 2x2 mesh composed with expert parallelism on the
    other axis.  Every loss, gradient and parameter as serial (the packed weight handed back in the model's own
    ``(experts, 2 ffn, hidden)``), and the plan's ``moe`` rows say where the experts are split inside."""
    from soybean.verify.sweep import LR, STEPS, differences, exact_serial
    from soybean.verify.testing import train_parallel_threads, train_serial

    model, inputs, p = _ffn_split_plan(name, mesh)
    assert p.moe and all(r["ffn_axes"] == [0] for r in p.moe)
    assert all(r["axes"] == ([1] if len(mesh) > 1 else []) for r in p.moe)
    assert {tuple(v) for k, v in p.params.items() if k.endswith("experts.gate_up_proj")} == {
        ("S(2)", "S(0)")[:len(mesh)]}
    serial = train_serial(model, inputs, steps=STEPS, lr=LR)
    par, _ = train_parallel_threads(model, inputs, plan=p, steps=STEPS, lr=LR)
    assert par.params.keys() >= {k for k, _ in model.named_parameters() if k.endswith("gate_up_proj")}
    assert not differences(serial, exact_serial(model, inputs, serial), par)  # judged against the float64 run


def _save_inside_load_by_expert(rank: int, world: int, plan_path: str, ckpt: str) -> dict[str, object]:
    """Train two steps with the experts split inside (``plan_path``), save; load into a fresh model planned with the
    experts split by expert (rows moved), and step it on."""
    import soybean
    from soybean.plan import Plan
    from soybean.verify.testing import loss_of

    def step(pm: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        loss = loss_of(pm(**inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    arch = next(a for a in archs.ARCHS if a.name == "mixtral")
    model, inputs = archs.build(arch)
    a = soybean.parallelize(model, inputs, plan=Plan.load(plan_path))
    opt = torch.optim.AdamW(a.parameters(), lr=0.01)
    [step(a, opt) for _ in range(2)]
    want = a.full_state_dict()
    a.save_sharded(ckpt, optimizer=opt)
    went_on = step(a, opt)
    out: dict[str, object] = {"went_on": went_on, "tiles": tuple(a.get_parameter(
        "model.layers.0.mlp.experts.gate_up_proj").shape)}
    fresh, _ = archs.build(arch)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    b = soybean.parallelize(fresh, inputs, devices=world, objective="comm")
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.01)
    b.load_sharded(ckpt, optimizer=opt_b)
    got = b.full_state_dict()
    out.update(equal=all(torch.equal(got[k], v) for k, v in want.items()), next=step(b, opt_b),
               experts=[(r["axes"], r["ffn_axes"]) for r in b.plan.moe])
    return out


def _a_checkpoint_saved_with_the_experts_split_inside_loads_under_expert_parallelism(got: list[dict]) -> None:
    """A checkpoint (weights and AdamW's moments) of a plan splitting each expert inside along its FFN dim loads
    under a plan splitting the experts by expert (DCP reshards the packed weight as the graph stores it,
    ``(experts, 2, ffn, hidden)``): the same full state, in the model's own shapes, and the next step's loss is the
    one the saving run took."""
    for r in got:
        assert r["tiles"] == (4, 2, 64, 64)  # this rank's half of every expert's pairs
        assert r["equal"] and abs(r["next"] - r["went_on"]) <= 1e-5 * abs(r["went_on"]), r
        assert r["experts"] == [([0], []), ([0], [])]  # loaded split by expert, not inside


def _gloo_cases(rank: int, world: int, plan_path: str, ckpt: str) -> dict[str, object]:
    """Every 2-process case in turn, in this one process group (their start-up was most of each run): ``sweep``'s
    gloo rank of each MoE under ``comm``, then the checkpoint case."""
    from soybean.verify import sweep

    out: dict[str, object] = {name: sweep._gloo_rank(rank, world, f"arch:{name}", "comm", sweep.STEPS, sweep.LR)
                              for name in ("mixtral", "deepseek_v3")}
    out["checkpoint"] = _save_inside_load_by_expert(rank, world, plan_path, ckpt)
    return out


@pytest.mark.dist
def test_gloo_processes_train_with_expert_parallelism_and_checkpoint_as_serial(tmp_path) -> None:
    """Two gloo processes (``parallelize``), Mixtral and DeepSeek-V3: under the plan that minimises communication
    every MoE layer's experts are split 2 ways with rows moved by all-to-all, and training equals the serial run.
    Then ``_a_checkpoint_saved_with_the_experts_split_inside_loads_under_expert_parallelism`` on the same
    processes."""
    from soybean.runtime.launch import spawn
    from soybean.verify.sweep import LR, STEPS, build, differences, exact_serial
    from soybean.verify.testing import train_serial

    _, _, p = _ffn_split_plan("mixtral", (2,))
    path = str(tmp_path / "plan.json")
    p.save(path)
    got = spawn(_gloo_cases, 2, path, str(tmp_path / "ckpt"), timeout_s=600)
    for name in ("mixtral", "deepseek_v3"):
        par, params = got[0][name]  # rank 0's trace, as ``sweep.train`` reads it
        model, inputs = build(f"arch:{name}")
        experts = {k: v for k, v in params.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        assert experts and all(v == ["S(0)"] for v in experts.values()), (name, experts)
        serial = train_serial(model, inputs, steps=STEPS, lr=LR)
        assert not differences(serial, exact_serial(model, inputs, serial), par), name
    _a_checkpoint_saved_with_the_experts_split_inside_loads_under_expert_parallelism([r["checkpoint"] for r in got])


def test_expert_parallel_fsdp_is_a_baseline_the_plan_is_never_worse_than() -> None:
    """``ep_fsdp`` (torchtitan's EP x FSDP): experts split over the node's axis, FSDP over the other; priced for a
    model with routed experts only, and the plan, searching every mesh, is no slower."""
    from soybean.planner import baselines
    from soybean.planner.core import plan

    from soybean.models import load

    model, inputs = load("hf:mixtral", dict(hidden_size=64, intermediate_size=128, num_local_experts=4,
                                            num_hidden_layers=2, vocab_size=128, batch=4, seq=8))
    cap = capture(model, inputs)
    lay = baselines.layouts(cap, 4, gpus_per_node=2)["ep_fsdp"]
    assert lay.mesh == Mesh((2, 2)) and not lay.infeasible
    experts = baselines.expert_weights(cap)
    assert len(experts) == 4 and set(experts.values()) == {4}
    assert all(lay.domains[f] == [(Shard(1), Shard(0))] and lay.gather_of[f] == (0,) for f in experts)
    p = plan(None, (), captured=cap, devices=4, gpus_per_node=2)
    ep = p.baselines["ep_fsdp"]
    assert "infeasible" not in ep and p.cost["step_time_s"] <= ep["step_time_s"] * (1 + 1e-9)
    dense = capture(*archs.build(next(a for a in archs.ARCHS if a.name == "llama")))
    assert "ep_fsdp" not in baselines.layouts(dense, 4, gpus_per_node=2)


def test_explain_and_draw_show_the_dispatch() -> None:
    """A plan moving rows: ``explain`` lists the op's all-to-alls as ``dispatch_combine`` steps (forward and
    backward), ``draw`` counts them in the layer's badge and lists them in its tooltip, the report prints the layer."""
    from soybean.report.draw import svg
    from soybean.report.explain import explain
    from soybean.planner.core import plan
    from soybean.report.table import table

    model, inputs = archs.build(next(a for a in archs.ARCHS if a.name == "mixtral"))
    cap = capture(model, inputs)
    p = plan(None, (), captured=cap, devices=2, objective="comm", baselines=False)
    ex = explain(cap, p)
    steps = [(c.step, c.phase) for r in ex.rows for c in r.collectives if c.step.startswith("dispatch_combine")]
    assert ("dispatch_combine[axis 0]", "forward") in steps and ("dispatch_combine[axis 0]", "backward") in steps
    assert "dispatch_combine[axis 0]" in svg(ex)
    assert "model.layers.0: 4 experts (top-2), split 2-way over mesh axes [0], rows moved by all-to-all on [0]" \
        in table(p)
    # experts split inside: no op communication of their own (the pending sum is an edge's), the report says where
    _, _, inside = _ffn_split_plan("mixtral", (2,))
    ex = explain(cap, inside)
    assert not [c for r in ex.rows for c in r.collectives if c.step.startswith("dispatch_combine")]
    assert "model.layers.0: 4 experts (top-2), every expert on every rank; each split inside along its FFN dim on [0]" \
        in table(inside) and svg(ex)


def test_the_memory_model_counts_the_rows_the_op_keeps_for_backward() -> None:
    """What autograd keeps inside the fused op (Mixtral's body: the gathered rows, the gate-up output, the
    activation's operands, the down projection's input) measured with ``saved_tensors_hooks``, against
    ``cost.memory.saved``'s estimate: within a quarter."""
    from soybean.cost.memory import saved

    x, idx, w, params, experts, body = _body_case(tokens=64, experts=4)
    leaves = [x.requires_grad_(), w.requires_grad_(), *(p.requires_grad_() for p in params)]
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = OP(x, idx, w, params, experts, body)
    mine = {t.untyped_storage().data_ptr() for t in [*leaves, idx]}
    inside = sum(b for ptr, b in kept.items() if ptr not in mine)
    op = make_opspec(OP, (x, idx, w, params, experts, body), {}, out)
    est = sum(f * out.numel() * out.element_size() for _, f in saved(op, [True, False, True, True, True]).extra)
    assert 0.75 * inside <= est <= 1.25 * inside, (est, inside)


class _Logged:
    """A group that logs each all-to-all of rows (its local buffer's bytes) and delegates it."""

    def __init__(self, inner: object, log: list[float]) -> None:
        self.inner, self.log = inner, log
        self.size, self.index = inner.size, inner.index  # type: ignore[attr-defined]

    def all_to_all_rows(self, t: torch.Tensor, send: tuple, recv: tuple) -> torch.Tensor:
        self.log.append(float(t.numel() * t.element_size()))
        return self.inner.all_to_all_rows(t, send, recv)  # type: ignore[attr-defined]


def test_the_bytes_moved_are_the_bytes_priced_under_balanced_routing() -> None:
    """Expert parallelism on 2 members with every member sending half its rows to each (the routing the pricing
    assumes): the all-to-alls the program runs, forward and backward, in order and byte for byte, are
    ``op_comm_calls``' (counts, rows, their ids, the results; the two gradients' moves)."""
    from soybean.cost.collectives import op_comm_calls
    from soybean.runtime.context import use_groups
    from soybean.runtime.experts import sb_routed_experts
    from soybean.tiling import chunk_range

    x, idx, w, params, experts, body = _body_case(tokens=8, experts=4)
    idx = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]] * 2)  # each member's 8 rows: 4 for each member's experts
    op = make_opspec(OP, (x, idx, w, params, experts, body), {}, routed_experts(x, idx, w, params, experts, body))
    mesh = Mesh((2,))
    st = next(s for s in expand(op, mesh) if isinstance(s.inputs[0][0], Shard) and isinstance(s.inputs[3][0], Shard))
    want = [c.bytes for c in op_comm_calls(op, st, [True, False, True, True, True], mesh)]
    logs: list[list[float]] = [[], []]

    def member(rank: int, groups: list) -> None:
        a, b = chunk_range(8, 2, rank)
        e0, e1 = chunk_range(experts, 2, rank)
        mine = [x[a:b].clone().requires_grad_(True), idx[a:b], w[a:b].clone().requires_grad_(True),
                [p[e0:e1].clone().requires_grad_(True) for p in params]]
        with use_groups([_Logged(groups[0], logs[rank])]):
            out = sb_routed_experts(*mine, experts, body, shard=(0,), a2a=(0,))
            out.sum().backward()

    run_threads(mesh, member)
    assert logs[0] == logs[1] == want


def test_the_capture_cache_keeps_the_fused_op() -> None:
    """A capture with routed experts stored as data and read back (``capture_cache``): the same op, its body and
    weights, the same structural keys (so a plan made on one loads on the other)."""
    from soybean.capture import cache as capture_cache

    model, inputs = tiny("mixtral")
    cap = capture(model, inputs)
    back = capture_cache.loads(capture_cache.dumps(cap))
    assert [n.args[4:] for n in _fused(back)] == [n.args[4:] for n in _fused(cap)]
    assert [[w.name for w in n.args[3]] for n in _fused(back)] == [[w.name for w in n.args[3]] for n in _fused(cap)]
    assert back.keys == cap.keys and back.fingerprint == cap.fingerprint


def test_routing_imbalance_scales_the_split_experts_moves_and_work() -> None:
    """``--expert-imbalance F``: a strategy splitting the experts pays F times the balanced rows in its all-to-alls
    (not in the counts' exchange) and F times its share of the experts' compute; one that keeps them whole pays the
    same as before.  The plan records F, and below 1 is refused."""
    from dataclasses import replace

    from soybean.cost.collectives import op_comm_calls
    from soybean.cost.compute import op_seconds
    from soybean.cost.profiles import load_profile
    from soybean.options import PlanOptions
    from soybean.planner.core import plan

    args = _body_case(tokens=6, experts=4)
    op = make_opspec(OP, args, {}, routed_experts(*args))
    mesh = Mesh((2,))
    sts = expand(op, mesh)
    ep = next(s for s in sts if isinstance(s.inputs[0][0], Shard) and isinstance(s.inputs[3][0], Shard))
    dp = next(s for s in sts if isinstance(s.inputs[0][0], Shard) and not isinstance(s.inputs[3][0], Shard))
    grads = [True, False, True, True, True]
    even, skew = op_comm_calls(op, ep, grads, mesh), op_comm_calls(op, ep, grads, mesh, 1.5)
    assert skew[0] == even[0] and all(b[2] == 1.5 * a[2] for a, b in zip(even[1:], skew[1:]))
    prof = replace(load_profile("h100-nvlink"), op_s=0.0, mem_bw=1e30)  # compute-bound: the FLOPs decide
    base = op_seconds(op, [ep, dp], grads, mesh, prof)
    more = op_seconds(op, [ep, dp], grads, mesh, replace(prof, expert_imbalance=1.5))
    assert more[0] == pytest.approx(1.5 * base[0]) and more[1] == base[1]
    model, inputs = tiny("mixtral")
    p = plan(model, inputs, 2, objective="comm", expert_imbalance=1.25, baselines=False)
    assert {r["imbalance"] for r in p.moe} == {1.25}
    with pytest.raises(ValueError, match="--expert-imbalance"):
        PlanOptions(expert_imbalance=0.5)


def test_a_plan_of_parts_lists_its_parts_moe_rows() -> None:
    """A placed or pipelined plan holds its tilings in its parts' plans; its own ``moe`` (and ``context_parallel``)
    rows are theirs, in order, each naming its part, so the record and the bench report the experts of such plans
    too (``Plan.part_rows``), and they survive the JSON."""
    from soybean.plan import Plan

    _, _, p = _ffn_split_plan("mixtral", (2,))
    moe, cp = Plan.part_rows([p, p], "region")
    assert [r["region"] for r in moe] == [0, 0, 1, 1] and [r["layer"] for r in moe] == [r["layer"] for r in p.moe] * 2
    assert cp == [] and all(r["ffn_axes"] == [0] for r in moe)
    whole = Plan(devices=2, mesh=[2], objective="time", profile=p.profile, fingerprint=p.fingerprint, params={},
                 inputs={}, nodes={}, cost={}, precision=p.precision, moe=moe, context_parallel=cp)
    assert Plan.from_dict(json.loads(whole.to_json())).moe == moe and "context_parallel" not in whole.to_dict()


def test_a_shared_packed_weight_is_the_models_own_parameter_read_as_pairs() -> None:
    """``share_params`` (torch.compile's backend): a weight stored whole is the model's own ``nn.Parameter``, so an
    optimizer over the model trains it; the packed gate and up weight is read by the program as its pairs (a view)
    and its gradient lands on the model's parameter, equal to the serial model's; ``full_state_dict`` is in the
    model's shapes."""
    import copy

    import soybean
    from soybean.verify.testing import loss_of

    model, inputs = archs.build(next(a for a in archs.ARCHS if a.name == "mixtral"))
    serial = copy.deepcopy(model)
    pm = soybean.parallelize(model, inputs, devices=1, share_params=True)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert pm.get_parameter(name) is model.get_parameter(name)
    loss_of(pm(**inputs)).backward()
    loss_of(serial(**inputs)).backward()
    torch.testing.assert_close(model.get_parameter(name).grad, serial.get_parameter(name).grad)
    assert pm.full_state_dict()[name].shape == serial.get_parameter(name).shape
