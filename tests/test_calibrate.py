"""Calibration: the ring-model fit recovers known alpha/beta; profiles load from JSON."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from soybean.bench.calibrate import ALGO_KINDS, MIN_BANDWIDTH_SHARE, _terms, beta_curve, fit, split_kind
from soybean.cost.collectives import RING_FACTOR
from soybean.cost.profiles import Profile, load_profile

pytestmark = pytest.mark.unit


def test_fit_recovers_alpha_beta() -> None:
    """The backend's calls (each collective's name) by their own rounds and bytes, the all-to-all by the ring."""
    from soybean.ir.algorithms import terms

    alpha, beta, world = 2e-4, 1e-9, 4
    rows = []
    for kind in RING_FACTOR:
        for m in (4096, 1 << 20, 64 << 20):
            ring = (world - 1, (world - 1) / world * m)  # the all-to-all
            rounds, sent = terms(kind, "backend", m, world) if kind in ALGO_KINDS else ring
            rows.append({"kind": kind, "bytes": m, "seconds": float(rounds * alpha + sent * beta)})
    a, b = fit(rows, world)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_fit_recovers_each_algorithms_alpha_beta() -> None:
    """An algorithm's rows are fitted to its own rounds and bytes (``ir.algorithms.terms``)."""
    from soybean.ir.algorithms import terms

    alpha, beta, world = 3e-4, 2e-9, 4
    for key in ALGO_KINDS:
        rows = []
        for m, k in ((4096, 1), (1 << 20, 4), (64 << 20, 16)):
            rounds, sent = terms(*split_kind(key), m, world, k)
            rows.append({"kind": key, "bytes": m, "chunks": k, "seconds": float(rounds * alpha + sent * beta)})
        a, b = fit(rows, world)
        assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6), key


def test_beta_curve_gives_back_every_measured_time_and_interpolates_in_log_m() -> None:
    """A bandwidth that halves from 1 MB to 64 MB (caches): the fitted line misses it, the curve gives back each
    measured time with the fitted alpha, and between two sizes beta is linear in log m."""
    world, alpha = 4, 1e-4
    rows = [{"kind": "all_reduce:ring", "bytes": m, "chunks": 1,
             "seconds": 6 * alpha + 1.5 * m * (1e-9 if m <= (1 << 20) else 2e-9)}
            for m in (1 << 10, 1 << 20, 64 << 20)]
    a, b = fit(rows, world)
    curve = beta_curve(rows, world, a)
    assert [m for m, _ in curve] == [1 << 10, 1 << 20, 64 << 20]
    prof = Profile("x", alpha=1e-4, beta=1e-9, flops=1e10, mem_bw=1e9, memory_gb=8,
                   collectives=(("all_reduce:ring", a, b),), beta_curves=(("all_reduce:ring", curve),))
    for r in rows[1:]:  # the bandwidth term is most of these
        rounds, sent, m = _terms(r, world)
        a_m, b_m = prof.ab(0, "all_reduce", "ring", m)
        assert rounds * a_m + sent * b_m == pytest.approx(r["seconds"], rel=1e-9)
    b_mid = prof.ab(0, "all_reduce", "ring", 8 << 20)[1]  # 8 MB: half way from 1 MB to 64 MB in log m
    assert b_mid == pytest.approx((curve[1][1] + curve[2][1]) / 2, rel=1e-9)
    assert prof.ab(0, "all_reduce", "ring", 1 << 30)[1] == curve[2][1]  # the end point's beyond it
    assert prof.ab(0, "all_reduce", "ring") == (a, b)  # no message: the fitted line
    many = prof.ab(0, "all_reduce", "ring", np.array([1 << 20, 8 << 20]))[1]
    assert many.tolist() == [prof.ab(0, "all_reduce", "ring", 1 << 20)[1], b_mid]
    # a per-axis override and another key's calls take no curve
    assert replace(prof, axis_beta=(5e-9,)).ab(0, "all_reduce", "ring", 8 << 20) == (a, 5e-9)
    assert prof.ab(0, "all_reduce", "backend", 8 << 20) == (1e-4, 1e-9)


def test_profile_json_roundtrip_ignores_measurements(tmp_path) -> None:
    p = Profile("x", alpha=1e-4, beta=2e-9, flops=1e10, mem_bw=1e9, memory_gb=8,
                collectives=(("all_gather", 3e-4, 4e-9),),
                beta_curves=(("all_gather", ((1e3, 4e-9), (1e6, 5e-9))),))
    d = json.loads(p.to_json())
    d["measurements"] = {"collectives": []}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(d))
    q = load_profile(str(path))
    assert q == p
    assert q.ab(0, "all_gather") == (3e-4, 4e-9) and q.ab(0, "all_reduce") == (1e-4, 2e-9)


@pytest.mark.dist
def test_calibrate_measures_every_field() -> None:
    """One short run on 2 gloo processes (messages up to 1 MiB: the large ones cost minutes and test nothing
    more): every rate positive, the overlap a share, and on a CPU the large-allocation rate measured (the caching
    allocator of a GPU has no page faults)."""
    from soybean.bench.calibrate import calibrate

    prof, raw = calibrate(devices=2, reps=2, show=False, sizes=(4 << 10, 64 << 10, 1 << 20))
    assert prof.alpha > 0 and prof.beta > 0 and prof.flops > 0 and prof.conv_flops > 0 and prof.mem_bw > 0
    assert prof.optimizer_bw > 0
    assert prof.optimizer_large_bw > 0 and prof.optimizer_tensor_s > 0
    assert 0.0 < prof.op_s < 1e-3  # microseconds of dispatch per pass of an op
    assert {k for k, _, _ in prof.collectives} == set(RING_FACTOR) | set(ALGO_KINDS) | {"p2p"}
    assert 0.0 <= prof.grad_overlap <= 1.0
    assert 0.0 <= prof.blocking_s < 0.1  # a wait per blocking collective, never a gain
    assert prof.alloc_bw > 0 and prof.large_alloc == 32 << 20
    assert {r["kind"] for r in raw["collectives"]} == set(RING_FACTOR) | {"p2p"} | set(ALGO_KINDS)
    # the planner reads each algorithm's own fit
    assert prof.ab(0, "all_reduce", "lp") == next((a, b) for k, a, b in prof.collectives if k == "all_reduce:lp")
    # ... and, given the message, its measured bandwidth there: every calibrated time comes back (a latency-bound
    # one's bandwidth term floored); lp on a chain is timed at two chunk counts, so that alpha is measured
    curves = dict(prof.beta_curves)
    assert set(curves) == set(RING_FACTOR) | set(ALGO_KINDS)
    rows = [r for r in raw["collectives"] if r["kind"] != "p2p"]
    per_message = Counter((r["kind"], r["bytes"]) for r in rows)
    assert all(per_message[key, m] == 2 for key, m in per_message if key == "all_reduce:lp")
    for r in rows:
        if per_message[r["kind"], r["bytes"]] == 1:
            kind, algo = split_kind(r["kind"])
            rounds, sent, m = _terms(r, 2)
            a, b = prof.ab(0, kind, algo, m)
            t = r["seconds"]
            assert rounds * a + sent * b == pytest.approx(max(t, rounds * a + MIN_BANDWIDTH_SHARE * t), rel=1e-6), r


def test_calibrate_needs_two_message_sizes() -> None:
    from soybean.bench.calibrate import calibrate

    with pytest.raises(ValueError, match="two message sizes"):
        calibrate(devices=2, sizes=(4 << 10, 4 << 10))
