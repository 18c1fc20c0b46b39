"""The 8B projection's arithmetic: figures made from known per-layer costs are projected back to them."""

from __future__ import annotations

import pytest

from benchmarks.probes import projection_8b as probe

# Known costs: a layer's weights 200 bytes, outside 1,000; a pool 3 bytes per layer and token; a step per layer
# 2 + 0.001 * tokens ms (1 agent) or 5 + 0.004 * tokens (15 agents), outside 40 ms; a build per layer
# 1e-3 * t + 1e-7 * t^2 s, outside 1e-4 * t; a build's peak 10 bytes per layer and token, outside 4 per token.
CONTEXTS = [2048, 8192]


def _cut(layers: int) -> dict:
    def point(t: int) -> dict:
        return {
            "context_tokens": t,
            "pool_bytes": 3 * layers * t,
            "pool_build_s": layers * (1e-3 * t + 1e-7 * t**2) + 1e-4 * t,
            "pool_build_peak_over_rss_bytes": (10 * layers + 4) * t,
            "step_ms": {"1": 40 + layers * (2 + 0.001 * t), "15": 40 + layers * (5 + 0.004 * t)},
        }

    weights = 1000 + 200 * layers
    return {"weights_bytes": weights, "load": {"rss_bytes": 5000 + weights}, "points": [point(t) for t in CONTEXTS]}


def test_the_projection_recovers_the_per_layer_costs_it_was_measured_from():
    p = probe.project({1: _cut(1), 2: _cut(2)}, CONTEXTS, layers=32, tokens=32_768)
    t = 32_768
    assert p["weights_bytes"] == 1000 + 32 * 200
    assert p["pool_bytes"] == pytest.approx(3 * 32 * t)
    assert p["step_ms_1"] == pytest.approx(40 + 32 * (2 + 0.001 * t))
    assert p["step_ms_15"] == pytest.approx(40 + 32 * (5 + 0.004 * t))
    assert p["decode_tok_s_15"] == pytest.approx(15 * 1000 / p["step_ms_15"])
    assert p["pool_build_s"] == pytest.approx(32 * (1e-3 * t + 1e-7 * t**2) + 1e-4 * t)
    assert p["pool_build_peak_over_rss_bytes"] == pytest.approx((10 * 32 + 4) * t)
    assert p["rss_after_pool_bytes"] == pytest.approx(5000 + p["weights_bytes"] + p["pool_bytes"])


def test_the_table_says_it_is_a_projection():
    result = {
        "settings": {"layers": 32, "target_tokens": 32_768, "contexts": CONTEXTS},
        "provenance": {"git_commit": "abcdef0123"},
        "cuts": {str(k): {**_cut(k), "weights": "int8", "threads": 2} for k in (1, 2)},
        "projection": probe.project({1: _cut(1), 2: _cut(2)}, CONTEXTS, layers=32, tokens=32_768),
        "assumptions": list(probe.ASSUMPTIONS),
    }
    table = probe.markdown(result)
    assert table.startswith("**A projection, not a measurement**") and "commit abcdef0" in table
    assert "| 2 | 8,192 |" in table
