"""Calibration: the ring-model fit recovers known alpha/beta; profiles load from JSON."""
from __future__ import annotations

import json

import pytest

from soybean.cost.calibrate import ALGO_KINDS, fit, split_kind
from soybean.cost.collectives import RING_FACTOR
from soybean.cost.profiles import Profile, load_profile

pytestmark = pytest.mark.unit


def test_fit_recovers_alpha_beta() -> None:
    alpha, beta, world = 2e-4, 1e-9, 4
    rows = []
    for kind, f in RING_FACTOR.items():
        for m in (4096, 1 << 20, 64 << 20):
            full = m * world if kind == "all_gather" else m
            rows.append({"kind": kind, "bytes": m, "seconds": f * (world - 1) * alpha + f * (world - 1) / world * full * beta})
    a, b = fit(rows, world)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_fit_recovers_each_algorithms_alpha_beta() -> None:
    """An algorithm's rows are fitted to its own rounds and bytes (``runtime.algorithms.terms``)."""
    from soybean.runtime.algorithms import terms

    alpha, beta, world = 3e-4, 2e-9, 4
    for key in ALGO_KINDS:
        rows = []
        for m, k in ((4096, 1), (1 << 20, 4), (64 << 20, 16)):
            rounds, sent = terms(*split_kind(key), m, world, k)
            rows.append({"kind": key, "bytes": m, "chunks": k, "seconds": float(rounds * alpha + sent * beta)})
        a, b = fit(rows, world)
        assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6), key


def test_profile_json_roundtrip_ignores_measurements(tmp_path) -> None:
    p = Profile("x", alpha=1e-4, beta=2e-9, flops=1e10, mem_bw=1e9, memory_gb=8, collectives=(("all_gather", 3e-4, 4e-9),))
    d = json.loads(p.to_json())
    d["measurements"] = {"collectives": []}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(d))
    q = load_profile(str(path))
    assert q == p
    assert q.ab(0, "all_gather") == (3e-4, 4e-9) and q.ab(0, "all_reduce") == (1e-4, 2e-9)


@pytest.mark.dist
def test_calibrate_measures_every_field() -> None:
    """One short run on 2 gloo processes: every rate positive, the overlap a share, and on a CPU
    the large-allocation rate measured (the caching allocator of a GPU has no page faults)."""
    from soybean.cost.calibrate import calibrate

    prof, raw = calibrate(devices=2, reps=2, show=False)
    assert prof.alpha > 0 and prof.beta > 0 and prof.flops > 0 and prof.conv_flops > 0 and prof.mem_bw > 0 and prof.optimizer_bw > 0
    assert prof.optimizer_large_bw > 0 and prof.optimizer_tensor_s > 0
    assert {k for k, _, _ in prof.collectives} == set(RING_FACTOR) | set(ALGO_KINDS) | {"p2p"}
    assert 0.0 <= prof.grad_overlap <= 1.0
    assert 0.0 <= prof.blocking_s < 0.1  # a wait per blocking collective, never a gain
    assert prof.alloc_bw > 0 and prof.large_alloc == 32 << 20
    assert {r["kind"] for r in raw["collectives"]} == set(RING_FACTOR) | {"p2p"} | set(ALGO_KINDS)
    # the planner reads each algorithm's own fit
    assert prof.ab(0, "all_reduce", "lp") == next((a, b) for k, a, b in prof.collectives if k == "all_reduce:lp")
