"""Summaries of repeated measurements: medians for timings, means with confidence intervals for
quality deltas, and paired comparisons of per-item scores (bootstrap intervals, discordant counts, the exact
sign test)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

from pydantic import BaseModel


class Interval(BaseModel):
    """Mean of ``n`` samples with a two-sided Student-t confidence interval, plus the range."""

    mean: float
    low: float
    high: float
    min: float
    max: float
    n: int
    confidence: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def mean_interval(samples: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean and t-interval of ``samples`` (a single sample gives a zero-width interval)."""
    if not samples:
        msg = "mean_interval needs at least one sample"
        raise ValueError(msg)
    mean = statistics.fmean(samples)
    half = 0.0
    if len(samples) > 1:
        from scipy import stats  # the bench extra: imported where used, so the CLI starts without it

        sem = statistics.stdev(samples) / math.sqrt(len(samples))
        half = float(stats.t.ppf(0.5 + confidence / 2, df=len(samples) - 1)) * sem
    return Interval(
        mean=mean,
        low=mean - half,
        high=mean + half,
        min=min(samples),
        max=max(samples),
        n=len(samples),
        confidence=confidence,
    )


def median_after_warmup(repetitions: int, measure: Callable[[], float]) -> float:
    """The median of ``repetitions`` calls of ``measure`` after one untimed warm-up call (first passes,
    allocations, thread start)."""
    measure()
    return statistics.median(measure() for _ in range(repetitions))


def median_call_seconds(run: Callable[[], object], repetitions: int, warmups: int) -> float:
    """The median wall seconds of ``repetitions`` calls of ``run`` after ``warmups`` untimed ones."""
    for _ in range(warmups):
        run()
    times = []
    for _ in range(repetitions):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class PairedComparison(BaseModel):
    """One method's per-item scores against a reference's on the same items (``difference = method - ref``).

    Student-t intervals fail on such data: when few items differ, the sample deviation is tiny and the
    interval collapses to ``+0.0 (+0.0 to +0.0)`` however few items were compared. The bootstrap resamples
    whole items, and the discordant counts say how many items the comparison actually rests on."""

    mean: float
    """Mean paired difference."""
    low: float
    """Percentile-bootstrap interval of the mean difference (items resampled with replacement)."""
    high: float
    n: int
    """Items compared."""
    better: int
    """Items the method scored higher on than the reference."""
    worse: int
    """Items it scored lower on."""
    sign_test_p: float
    """Exact two-sided sign test (McNemar's exact test for 0/1 scores) on ``better`` against ``worse``;
    1.0 when no item differs."""
    confidence: float
    resamples: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_comparison(
    differences: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> PairedComparison:
    """Bootstrap interval, discordant counts and exact sign test of per-item paired ``differences``.

    Seeded, so that rendering the same committed answers always prints the same interval."""
    if not differences:
        msg = "paired_comparison needs at least one paired item"
        raise ValueError(msg)
    n = len(differences)
    better = sum(d > 0 for d in differences)
    worse = sum(d < 0 for d in differences)
    import numpy as np

    values = np.asarray(differences, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [resamples, n] item indices
    means = values[picks].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = (float(q) for q in np.quantile(means, [tail, 1 - tail]))
    return PairedComparison(
        mean=statistics.fmean(differences),
        low=low,
        high=high,
        n=n,
        better=better,
        worse=worse,
        sign_test_p=exact_sign_test(better, worse),
        confidence=confidence,
        resamples=resamples,
    )


def exact_sign_test(better: int, worse: int) -> float:
    """Two-sided exact binomial p-value of ``better`` successes in ``better + worse`` fair coin flips."""
    from scipy.stats import binomtest  # the bench extra: imported where used

    return float(binomtest(better, better + worse).pvalue) if better + worse else 1.0
