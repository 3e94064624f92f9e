"""The ``bf16-mixed`` precision policy end to end: planned, priced, run, and equal to the same policy serially.

Under ``bf16-mixed`` the plan is captured from the bfloat16 compute copy (so activations and
collectives are priced at 2 bytes), parameters stay float32 masters (the module's parameters, which
AdamW updates), gradients are reduced in bfloat16.  Training on 2 ranks (threads) equals
``train_serial(..., precision="bf16-mixed")`` to bfloat16's resolution (sums taken in another order
round differently: rtol 3e-2), every collective that runs is the priced one, and the modelled memory
holds the masters, their states and the compute copy.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from examples.models import mlp, transformer
from soybean.api import parallelize
from soybean.capture.core import capture
from soybean.mesh import Mesh
from soybean.planner.core import plan as make_plan
from soybean.runtime.launch import run_threads
from soybean.verify.testing import compare, train_parallel_threads, train_serial
from tests.test_priced_is_run import priced, run_one_step

pytestmark = pytest.mark.sim

MODELS = {
    "mlp": lambda: mlp(batch=8, hidden=16, layers=2),
    "transformer": lambda: transformer(batch=4, seq=8, hidden=16, layers=2, heads=4),
}
CASES = [("mlp", (2,), "dp"), ("mlp", (2,), "mp"), ("transformer", (2,), "auto"), ("transformer", (2, 2), "auto")]


@pytest.mark.parametrize("name,mesh,mode", CASES, ids=[f"{n}-{'x'.join(map(str, m))}-{d}" for n, m, d in CASES])
def test_bf16_mixed_trains_like_the_serial_policy(name: str, mesh: tuple[int, ...], mode: str) -> None:
    model, inputs = MODELS[name]()
    serial = train_serial(model, inputs, steps=2, precision="bf16-mixed")
    fp32 = train_serial(model, inputs, steps=2)
    assert serial.losses != fp32.losses  # the policy changes the arithmetic
    par, plan = train_parallel_threads(model, inputs, mesh=mesh, mode=mode, steps=2, precision="bf16-mixed")
    assert plan.precision == "bf16-mixed"
    assert all(p.dtype == torch.float32 for p in par.params.values())  # the masters
    bad = compare(serial, par, rtol=3e-2, atol=3e-3)
    assert not bad, "; ".join(bad[:5])


def test_module_keeps_fp32_masters_and_reduces_gradients_in_bf16() -> None:
    model, inputs = MODELS["mlp"]()
    cap = capture(model, inputs, precision="bf16-mixed")
    plan = make_plan(None, (), captured=cap, devices=2, mode="dp", baselines=False)

    def rank_fn(rank: int, groups: list) -> tuple:
        pm = parallelize(model, inputs, plan=plan, rank=rank, groups=groups, captured=cap)
        loss = pm(*inputs)
        loss.backward()
        float(loss)
        flats = [f for f in pm._grad_sync._flat if f is not None] if pm._grad_sync else []
        return loss.dtype, {p.dtype for p in pm.parameters()}, {p.grad.dtype for p in pm.parameters()}, \
            {f.dtype for f in flats}

    for loss_dtype, params, grads, flats in run_threads(Mesh((2,)), rank_fn):
        assert loss_dtype == torch.bfloat16 and params == grads == {torch.float32} and flats == {torch.bfloat16}


def test_what_runs_is_what_is_priced_in_bf16() -> None:
    """Collectives move bfloat16 bytes, the gradient sync included, exactly as the cost model priced them."""
    model, inputs = MODELS["transformer"]()
    cap = capture(model, inputs, precision="bf16-mixed")
    plan = make_plan(None, (), captured=cap, devices=2, mesh=(2,), mode="auto", objective="comm", baselines=False)
    want, want_sync, comm_bytes = priced(cap, plan)
    assert comm_bytes == pytest.approx(plan.cost["comm_bytes"], rel=1e-5, abs=1e-6)
    ran = Counter(run_one_step(model, inputs, plan, cap))
    assert not Counter(want) - ran
    extra = ran - Counter(want)
    got_sync: Counter[int] = Counter()
    for (kind, axis, m), n in extra.items():
        assert kind == "all_reduce"
        got_sync[axis] += m * n
    assert got_sync == want_sync


def test_memory_holds_masters_states_and_the_compute_copy() -> None:
    """Data parallel keeps every parameter whole: its term is a float32 master, gradient and two states,
    plus a bfloat16 compute copy (18 bytes a weight, against 16 in fp32); activations halve."""
    model, inputs = transformer(batch=8, seq=64, hidden=32, layers=2, heads=4)
    p32 = make_plan(model, inputs, devices=2, mode="dp", baselines=False)
    p16 = make_plan(model, inputs, devices=2, mode="dp", baselines=False, precision="bf16-mixed")
    m32, m16 = p32.memory, p16.memory
    assert m16["gradients"] == m32["gradients"] and m16["optimizer_states"] == m32["optimizer_states"]
    assert m16["parameters"] == pytest.approx(1.5 * m32["parameters"])
    assert m16["activations"] < 0.6 * m32["activations"]


def test_precision_mismatch_is_a_clear_error() -> None:
    model, inputs = MODELS["mlp"]()
    cap32 = capture(model, inputs)
    with pytest.raises(ValueError, match="captured under 'fp32'"):
        make_plan(None, (), captured=cap32, devices=1, baselines=False, precision="bf16-mixed")
    p16 = make_plan(model, inputs, devices=1, baselines=False, precision="bf16-mixed")
    with pytest.raises(ValueError, match="computes in bf16-mixed"):
        parallelize(model, inputs, plan=p16, devices=1, precision="fp32")
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        make_plan(model, inputs, devices=1, baselines=False, precision="fp16")
