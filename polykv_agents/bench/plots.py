"""matplotlib for the suites' figures, drawn off-screen. A suite's figure function imports ``plt`` from here
inside the function (matplotlib is the bench extra: listing the suites must not need it), draws, and returns
the figure; :func:`polykv_agents.bench.output.write_suite` saves and closes it."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt

__all__ = ["error_bars", "plt"]


def error_bars(means: Sequence[float], lows: Sequence[float], highs: Sequence[float]) -> list[list[float]]:
    """An interval per point as matplotlib's asymmetric error bars: distances below and above each mean."""
    return [
        [m - low for m, low in zip(means, lows, strict=True)],
        [high - m for m, high in zip(means, highs, strict=True)],
    ]
