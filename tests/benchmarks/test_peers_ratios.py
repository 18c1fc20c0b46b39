"""The per-document review ratios quoted for our non-default rows (README, docs/RUNTIME.md)."""

from __future__ import annotations

import pytest

from benchmarks.probes.peers_ratios import review_ratios


def _row(method: str, walls: list[float]) -> dict:
    return {"kind": "engine", "method": method, "samples": {"review_wall_s": walls}}


def test_each_of_our_rows_is_compared_with_each_peer_document_by_document():
    result = {"rows": [
        _row("polykv_agents (one pool)", [10.0, 20.0]),
        _row("llama.cpp (F16)", [30.0, 40.0]),
        _row("llama.cpp (Q4_1), reset before every call", [400.0, 400.0]),
        {"kind": "compression", "method": "quanto"},
    ]}  # fmt: skip
    [(ours, peer, mean, low, high)] = review_ratios(result)
    assert (ours, peer) == ("polykv_agents (one pool)", "llama.cpp (F16)")
    assert mean == pytest.approx(2.5)  # 30/10 and 40/20, not 70/30
    assert low < mean < high
