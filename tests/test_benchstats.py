"""The bench's statistics: rank correlation and the paired sign-test verdict."""
from __future__ import annotations

import random

import pytest

from soybean.bench.stats import fastest_verdict, median_interval, paired_ratio, spearman

pytestmark = pytest.mark.unit


def test_spearman_ranks_with_ties() -> None:
    assert spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert spearman([1.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(0.8660254)
    assert spearman([1.0], [2.0]) is None
    assert spearman([1.0, 1.0], [1.0, 2.0]) is None


def test_median_interval_order_statistics() -> None:
    # n = 20: P(B <= 5) = 0.0207, so k = 6 (coverage 95.9%), and P(B <= 6) = 0.0577 is too much
    assert median_interval([float(i) for i in range(20, 0, -1)]) == (6.0, 15.0)
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)  # n = 6: min..max covers 96.9%
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None              # n = 5: even min..max covers only 93.8%
    assert median_interval([]) is None


@pytest.mark.parametrize("n", [6, 13, 40])
def test_median_interval_covers_the_median_at_least_95_percent(n: int) -> None:
    rng = random.Random(n)
    trials = 3000
    # a heavy-tailed, skewed step-ratio distribution whose median is exactly 1
    hits = 0
    for _ in range(trials):
        xs = [1.0 + (rng.expovariate(1.0) - 0.6931471805599453) * 0.1 for _ in range(n)]
        lo, hi = median_interval(xs)  # type: ignore[misc]
        hits += lo <= 1.0 <= hi
    assert hits / trials >= 0.94  # the nominal coverage is >= 95%; 0.94 leaves room for sampling


def test_paired_ratio_divides_out_drift() -> None:
    drift = [1.0, 3.0, 1.5, 2.0, 4.0, 1.0, 2.5, 1.2]
    r = paired_ratio([d * 1.05 for d in drift], drift)
    assert r["ratio"] == pytest.approx(1.05) and r["ci95"] == pytest.approx([1.05, 1.05]) and r["pairs"] == 8
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio([1.0], [1.0, 2.0])


def test_fastest_verdict() -> None:
    rng = random.Random(0)
    base = [rng.uniform(0.4, 0.6) for _ in range(30)]
    noisy = lambda f: [b * f * rng.uniform(0.9, 1.1) for b in base]  # noqa: E731 -- 10% scatter per step
    assert fastest_verdict("a", {"a": base, "b": noisy(1.3), "c": noisy(1.5)})["verdict"] == "confirmed"
    assert fastest_verdict("a", {"a": base, "b": noisy(0.7)})["verdict"] == "contradicted"
    tied = fastest_verdict("a", {"a": base, "b": noisy(1.0)})
    assert tied["verdict"] == "unresolved"
    lo, hi = tied["versus"]["b"]["ci95"]
    assert lo < 1 < hi
    assert fastest_verdict("a", {"a": base[:4], "b": noisy(2.0)[:4]})["verdict"] == "unresolved"  # 4 pairs: no interval
