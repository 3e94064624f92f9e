"""Statistics for the benchmark: rank correlation, and whether one plan is measurably faster.

A shared machine's step time scatters by 10% or more from one step to the next, so two plans
whose true times differ by 2% swap places in a 16-step median about as often as not.  The bench
therefore asks a narrower question of its measurements: given the per-step times of plans that
took turns step by step, is the plan predicted fastest *significantly* faster, significantly
slower, or not distinguishable at this many steps?

Pairing.  Step ``i`` of every variant runs in round ``i`` (the variants take turns), so the ratio
``r_i = t_v[i] / t_p[i]`` compares the two plans under nearly the same machine state: drift over
the run divides out, and what remains is each step's own scatter.

Interval.  The sign-test (order-statistic) interval for the median of ``r``: with ``r`` sorted and
``B ~ Binomial(n, 1/2)``, ``[r_(k), r_(n+1-k)]`` (1-based) covers the true median with probability
``1 - 2 P(B <= k - 1)`` for any continuous distribution of ``r``; ``k`` is the largest index with
that coverage at least ``1 - alpha``.  No normality is assumed, which matters here: slow steps
(a page-fault storm, another tenant) give the ratios a heavy tail.  Below 6 pairs no 95% interval
exists and the verdict is ``unresolved``.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TypedDict

__all__ = ["spearman", "median_interval", "paired_ratio", "fastest_verdict"]

CONFIRMED = "confirmed"        # the predicted fastest is significantly faster than every other candidate
CONTRADICTED = "contradicted"  # some other candidate is significantly faster
UNRESOLVED = "unresolved"      # neither: the difference is within the steps' scatter


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); ``None`` below 2 points or with no spread."""
    if len(xs) != len(ys):
        raise ValueError("spearman needs two sequences of the same length")
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var > 0 else None


def _ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def median_interval(xs: Sequence[float], alpha: float = 0.05) -> tuple[float, float] | None:
    """The distribution-free ``1 - alpha`` interval for the median of ``xs`` (sign test, see the
    module docstring), or ``None`` when ``len(xs)`` is too small for that coverage."""
    n = len(xs)
    tail = 0.0  # P(B <= k - 1) for the current k
    k = 0
    while k < n // 2:
        nxt = tail + math.comb(n, k) / 2 ** n  # P(B <= k): the tail if the interval shrank to index k + 1
        if 2 * nxt > alpha:
            break
        tail, k = nxt, k + 1
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k]


class PairedRatio(TypedDict):
    ratio: float              # the median of the paired ratios
    ci95: list[float] | None  # [low, high], or None with too few pairs
    pairs: int


def paired_ratio(times: Sequence[float], reference: Sequence[float], alpha: float = 0.05) -> PairedRatio:
    """``times[i] / reference[i]`` over paired steps: the median ratio and its ``1 - alpha``
    interval (``None`` with too few pairs).  Above 1: ``times`` is the slower."""
    if len(times) != len(reference) or not times:
        raise ValueError("paired_ratio needs two equally long, non-empty step lists, "
                         f"got {len(times)} and {len(reference)}")
    ratios = [t / r for t, r in zip(times, reference)]
    ci = median_interval(ratios, alpha)
    return {"ratio": statistics.median(ratios), "ci95": None if ci is None else list(ci), "pairs": len(ratios)}


def fastest_verdict(predicted_fastest: str, steps: Mapping[str, Sequence[float]]) -> dict[str, object]:
    """Is ``predicted_fastest`` measurably the fastest of ``steps`` (variant -> paired step times)?

    ``versus``: every other variant's :func:`paired_ratio` against it.  The verdict is
    ``confirmed`` when every interval lies above 1, ``contradicted`` when some interval lies
    below 1, else ``unresolved``.
    """
    ref = steps[predicted_fastest]
    versus = {v: paired_ratio(ts, ref) for v, ts in steps.items() if v != predicted_fastest}
    cis = [r["ci95"] for r in versus.values()]
    if any(ci is not None and ci[1] < 1 for ci in cis):
        verdict = CONTRADICTED
    elif all(ci is not None and ci[0] > 1 for ci in cis):
        verdict = CONFIRMED
    else:
        verdict = UNRESOLVED
    return {"verdict": verdict, "versus": versus}
