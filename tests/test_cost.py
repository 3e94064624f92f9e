"""The cost model's parts: backward passes per op, page faults of large tensors, the gradient
sync's share of a reshard, the wait at blocking collectives, and the overlap the planner credits (capped by backward compute)."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from soybean.capture.core import capture
from soybean.cost.collectives import price_routes, reshard_cost
from soybean.cost.compute import compute_seconds, op_seconds, passes
from soybean.cost.profiles import BUILTIN
from soybean.mesh import Mesh
from soybean.options import PlanOptions
from soybean.planner.solve import BACKWARD_SHARE, Search, solve_on
from soybean.reshard import Route
from soybean.rules.base import Strategy, make_opspec
from soybean.tiling import Partial, R, Shard

pytestmark = pytest.mark.unit

PROFILE = BUILTIN["cpu-gloo"]


def _op(target, *args):
    return make_opspec(target, args, {}, target(*args))


def test_backward_passes_follow_the_operands_that_need_gradients() -> None:
    x, w, b = torch.randn(4, 3), torch.randn(5, 3), torch.randn(5)
    lin = _op(torch.ops.aten.linear.default, x, w, b)
    assert passes(lin, [True, True, True]) == 3.0       # forward, input gradient, weight gradient
    assert passes(lin, [False, True, True]) == 2.0      # first layer: no input gradient
    assert passes(lin, [False, False, False]) == 1.0    # frozen: forward only
    relu = _op(torch.ops.aten.relu.default, x)
    assert passes(relu, [True]) == 2.0 and passes(relu, [False]) == 1.0
    assert passes(_op(torch.ops.aten.view.default, x, [12]), [True]) == 0.0  # a view moves nothing


def test_large_fresh_tensors_are_charged_their_page_faults() -> None:
    prof = replace(PROFILE, alloc_bw=1e9, op_s=0.0)
    assert compute_seconds(0.0, 0.0, 1.0, prof, 1.0, fresh_bytes=2e9) == pytest.approx(2.0)
    assert compute_seconds(0.0, 0.0, 1.0, replace(prof, alloc_bw=0.0), 1.0, fresh_bytes=2e9) == 0.0


def test_every_pass_of_an_op_pays_its_fixed_cost_whatever_the_split() -> None:
    """``op_s`` per forward-equivalent pass, not divided by the devices that split the work; a view has no pass."""
    prof = replace(PROFILE, op_s=1e-3)
    x, w = torch.randn(64, 32), torch.randn(16, 32)
    lin = _op(torch.ops.aten.linear.default, x, w)
    mesh = Mesh((2,))
    batch = Strategy(((Shard(0),), (R,)), ((Shard(0),),))  # each device: half the rows, every pass
    whole = Strategy(((R,), (R,)), ((R,),))
    fixed = op_seconds(lin, [batch, whole], [True, True], mesh, prof) - op_seconds(
        lin, [batch, whole], [True, True], mesh, replace(prof, op_s=0.0))
    assert fixed == pytest.approx([3e-3, 3e-3])  # forward and two gradients, on either tiling
    assert op_seconds(lin, [whole], [False, False], mesh, prof)[0] == pytest.approx(
        op_seconds(lin, [whole], [False, False], mesh, replace(prof, op_s=0.0))[0] + 1e-3)  # frozen: forward only
    view = _op(torch.ops.aten.view.default, x, [2048])
    assert op_seconds(view, [Strategy(((R,),), ((R,),))], [True], mesh, prof)[0] == 0.0


def test_gradient_all_reduce_is_reported_as_sync() -> None:
    mesh, shape = Mesh((2,)), (64, 64)
    # a replicated weight used by batch-split work: its gradient all-reduce is all the cost
    c = reshard_cost(Route.of((R,), (R,), (0,), (), True), shape, 4, mesh, PROFILE)
    assert c.seconds > 0 and c.sync_seconds == pytest.approx(c.seconds)
    # gathering a split weight (FSDP-like) is no gradient sync
    c = reshard_cost(Route.of((Shard(0),), (R,), (), (), True), shape, 4, mesh, PROFILE)
    assert c.seconds > 0 and c.sync_seconds == 0.0


def test_each_blocking_collective_pays_the_wait() -> None:
    mesh, shape = Mesh((2,)), (64, 64)
    free, waits = replace(PROFILE, blocking_s=0.0), replace(PROFILE, blocking_s=1e-3)
    # gathering a split weight: a blocking all-gather forward (its backward, a slice, is free)
    gather = reshard_cost(Route.of((Shard(0),), (R,), (), (), True), shape, 4, mesh, waits)
    assert gather.seconds == pytest.approx(reshard_cost(Route.of((Shard(0),), (R,), (), (), True), shape, 4, mesh, free).seconds + 1e-3)
    # ... and when batch-split work leaves its gradient partial: a blocking reduce-scatter backward too
    fsdp = reshard_cost(Route.of((Shard(0),), (R,), (0,), (), True), shape, 4, mesh, waits)
    assert fsdp.seconds == pytest.approx(reshard_cost(Route.of((Shard(0),), (R,), (0,), (), True), shape, 4, mesh, free).seconds + 2e-3)
    # the asynchronous gradient all-reduce waits for nobody in the middle of compute
    sync = reshard_cost(Route.of((R,), (R,), (0,), (), True), shape, 4, mesh, waits)
    assert sync.seconds == pytest.approx(reshard_cost(Route.of((R,), (R,), (0,), (), True), shape, 4, mesh, free).seconds)
    # a one-device axis runs no collective and waits for nothing
    assert reshard_cost(Route.of((Shard(0),), (R,), (), (), True), shape, 4, Mesh((1,)), waits).seconds == 0.0


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_hidden_sync_is_capped_by_backward_compute(overlap: float) -> None:
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    cap = capture(net, (torch.randn(64, 256),))
    prof = replace(PROFILE, grad_overlap=overlap)
    r = solve_on(cap, Mesh((2,)), Search(prof, PlanOptions(mode="dp")))
    op_compute = sum(float(v.compute_s[c]) for v, c in zip(r.graph.vars, r.solution.choice) if v.kind == "op")
    assert r.sync_s > 0  # data parallel: every weight's gradient is summed
    assert r.hidden_s == pytest.approx(min(overlap * r.sync_s, BACKWARD_SHARE * op_compute))
    assert r.step_time_s == pytest.approx(r.comm_s + r.compute_s - r.hidden_s)


def test_overlap_makes_data_parallel_no_dearer() -> None:
    """Crediting the overlap can only lower a plan's modelled time, never raise the optimum."""
    net = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    cap = capture(net, (torch.randn(512, 128),))
    times = [solve_on(cap, Mesh((2,)), Search(replace(PROFILE, grad_overlap=ov))).step_time_s for ov in (0.0, 0.5, 1.0)]
    assert times[0] >= times[1] >= times[2]


@pytest.mark.parametrize("mesh_shape, nodes", [((2, 2, 2), None), ((4, 2), 2), ((3,), None), ((1, 2), None)])
def test_vectorised_pricing_equals_the_one_route_reference_bit_for_bit(mesh_shape: tuple, nodes: int | None) -> None:
    """``price_routes`` (numpy, many routes) against ``reshard_cost`` (one route, the definition), on an
    uneven shape, with and without gradients, partial-gradient axes, a blocking wait and an inter-node axis."""
    mesh = Mesh(mesh_shape)
    prof = replace(BUILTIN["h100-nvlink-ib"], blocking_s=3e-4).on_mesh(mesh, nodes)
    shape = (6, 10, 7)
    placements = [R, Shard(0), Shard(1), Shard(2), Partial()]
    tilings = list(itertools.product(placements, repeat=mesh.ndim))
    rng = random.Random(0)
    routes = []
    for _ in range(400):
        src, dst = rng.choice(tilings), rng.choice([t for t in tilings if Partial() not in t])
        grad = rng.random() < 0.7
        pga = tuple(a for a in range(mesh.ndim) if dst[a] == R and rng.random() < 0.5)
        spa = tuple(a for a in range(mesh.ndim) if src[a] == R and rng.random() < 0.3)
        routes.append(Route.of(src, dst, pga, spa, grad))
    B, T, S = price_routes(routes, shape, 4, mesh, prof)
    ref = [reshard_cost(r, shape, 4, mesh, prof) for r in routes]
    assert np.array_equal(B, [c.bytes for c in ref])
    assert np.array_equal(T, [c.seconds for c in ref])
    assert np.array_equal(S, [c.sync_seconds for c in ref])
    assert B.any() and S.any()  # the sample has collectives and gradient syncs to price


def test_float32_ops_run_at_the_profiles_float32_rate() -> None:
    """On the H100 profiles a float32 matmul runs at ``fp32_flops`` (measured 50 TFLOP/s: torch's default has no
    TF32), a bf16 one at ``flops``: the same product is priced 13x slower in float32; a profile without
    ``fp32_flops`` (the CPU's) prices both at one rate."""
    from soybean.cost.compute import op_flops
    from soybean.rules.base import OpSpec, TensorSpec

    h100 = BUILTIN["h100-nvlink"]
    ops = {}
    for dt in (torch.float32, torch.bfloat16):
        a, b, out = TensorSpec((4096, 4096), dt), TensorSpec((4096, 4096), dt), TensorSpec((4096, 4096), dt)
        ops[dt] = OpSpec("aten.mm.default", (a, b), {}, (a, b), (out,))
    assert op_flops(ops[torch.float32], h100) == h100.fp32_flops and op_flops(ops[torch.bfloat16], h100) == h100.flops
    mesh, s = Mesh((1,)), [Strategy(((R,), (R,)), ((R,),))]
    t32, t16 = (op_seconds(ops[dt], s, [True, True], mesh, h100)[0] for dt in (torch.float32, torch.bfloat16))
    assert t32 / t16 == pytest.approx(h100.flops / h100.fp32_flops, rel=1e-6)
    cpu = BUILTIN["cpu-gloo"]
    assert op_flops(ops[torch.float32], cpu) == op_flops(ops[torch.bfloat16], cpu) == cpu.flops


def test_causal_attention_is_priced_at_the_share_it_computes() -> None:
    """Causal attention without a mask: the fused kernels compute the scores below the diagonal only, so its FLOPs
    are ``sum_i min(i + 1, S) / (L S)`` of the full ones (about half; measured on an H100 at 8,192 tokens: 1.78 ms
    against 3.28 without the mask); a mask given as a tensor is priced whole."""
    from soybean.cost.compute import flops
    from soybean.ir.attention import causal_fraction
    from soybean.rules.base import OpSpec, TensorSpec

    q = TensorSpec((2, 4, 64, 8), torch.float32)
    full = OpSpec("aten.scaled_dot_product_attention.default", (q, q, q), {}, (q, q, q), (q,))
    causal = OpSpec("aten.scaled_dot_product_attention.default", (q, q, q), {"is_causal": True}, (q, q, q), (q,))
    assert flops(causal)[0] / flops(full)[0] == pytest.approx(causal_fraction(64, 64)) == pytest.approx(65 / 128)
    assert causal_fraction(3, 5) == pytest.approx((1 + 2 + 3) / 15) and causal_fraction(5, 2) == pytest.approx(9 / 10)


def test_a_data_dependent_size_is_priced_without_torchs_optimisation_hint() -> None:
    """On a torch without ``ShapeEnv.optimization_hint`` (before 2.12) a data-dependent size is priced at the value
    ``record_sizes`` recorded for its symbol, and at ``UNBOUNDED_HINT`` before one is recorded: never ``int()`` of
    an unbacked size (checked on an environment that hides the method)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from soybean.rules.base import UNBOUNDED_HINT, recorded_hints, symbol_hint

    env = ShapeEnv()
    u = env.create_unbacked_symint().node.expr

    class OldEnv:  # what symbol_hint reads of a torch 2.11 ShapeEnv
        def __init__(self) -> None:
            self.var_to_val: dict = {}

    old = OldEnv()
    assert symbol_hint(2 * u + 1, old) == UNBOUNDED_HINT
    recorded_hints(old)[u] = 5
    assert symbol_hint(2 * u + 1, old) == 11
    recorded_hints(env)[u] = 7  # torch's own optimisation hint reads the same record
    assert symbol_hint(2 * u + 1, env) == 15
