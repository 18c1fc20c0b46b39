"""Summaries of repeated measurements: medians for timings, means with confidence intervals for
quality deltas."""

from __future__ import annotations

import math
import statistics
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
