"""The peer comparison's glue: a wrong environment is a clear error; with a real peer environment
(``POLYKV_PEER_PYTHON`` pointing at a Python with polykv-llm 0.1.0) both sides run end to end."""

from __future__ import annotations

import os
import sys

import pytest

from benchmarks.studies.peer import PeerRunError, _run_peer


def test_an_environment_without_the_peer_is_a_clear_error():
    pytest.importorskip("torch")
    if "polykv" in sys.modules or os.environ.get("POLYKV_PEER_PYTHON") == sys.executable:
        pytest.skip("this environment has the peer installed")
    with pytest.raises(PeerRunError, match=r"(?s)polykv-llm==0\.1\.0.*No module named 'polykv'"):
        _run_peer(sys.executable, {"threads": 1}, timeout_s=120)


@pytest.mark.real_model
@pytest.mark.skipif(not os.environ.get("POLYKV_PEER_PYTHON"), reason="set POLYKV_PEER_PYTHON to a peer environment")
def test_both_sides_measure_the_same_tokens(smollm, tmp_path):
    from benchmarks.studies.peer import run_peer_suite
    from polykv_agents.eval.corpus import pydoc_documents

    model, tokenizer = smollm
    result = run_peer_suite(
        model, tokenizer, pydoc_documents(1, chars_per_document=4000), peer_python=os.environ["POLYKV_PEER_PYTHON"],
        context_tokens=256, continuation_tokens=64, max_new_tokens=4, agents=3,
    )  # fmt: skip
    rows = {r["metric"]: r for r in result.rows}
    assert rows["pool_nbytes"]["ours"] < rows["pool_nbytes"]["peer"]  # bit-packed vs one byte per code
    assert 1.5 < rows["ratio_vs_fp16"]["peer"] < 2.5 < rows["ratio_vs_fp16"]["ours"]
    assert rows["kv_bytes_agents_peak"]["ours"] < rows["kv_bytes_agents_peak"]["peer"]
