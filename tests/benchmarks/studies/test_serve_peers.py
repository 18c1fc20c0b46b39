"""The serving peers' glue: the recorded calls are those the workflows decode, the server replay starts every
workflow together, the table compares each N with the same N, and a separate ``bench serve`` run is never
overwritten. The measurements need llama.cpp (the [peers] extra); docs/RESULTS.md holds the committed ones."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from benchmarks.studies import serve_peers
from benchmarks.studies.serve_record_side import record
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import SuiteResult

GRAPHS = Path(__file__).resolve().parents[3] / "langgraph.json"


def _info(date: str = "2026-12-05") -> RunInfo:
    return RunInfo(
        machine="Linux x86_64", cpu="cpu", cpu_count=2, torch_threads=2, device="cpu", torch="2", transformers="5",
        python="3.11", model="m", dtype="bfloat16", date=date,
    )  # fmt: skip


def _row(workflows: int, mode: str, tok_s: float, rss: int = 2**30) -> dict:
    wall = 100.0 / tok_s
    return {
        "workflows": workflows, "mode": mode, "wall_s": wall, "output_tokens": 100, "aggregate_tok_s": tok_s,
        "latency_p50_s": wall, "latency_p95_s": wall, "ttft_p50_s": None, "ttft_p95_s": None,
        "rss_peak_bytes": rss, "runs": [],
    }  # fmt: skip


def _result(date: str = "2026-12-05") -> SuiteResult:
    rows = [
        _row(1, "at_once", 10.0), _row(1, "one_after_another", 10.0), _row(1, "llama_server", 8.0),
        _row(1, "llamacpp_one_after_another", 5.0),
        _row(2, "at_once", 18.0), _row(2, "one_after_another", 9.0), _row(2, "llama_server", 12.0, rss=2**29),
        _row(2, "llamacpp_one_after_another", 6.0),
    ]  # fmt: skip
    settings = {
        "context": 2048, "roles": 15, "max_tokens": 32, "graph": "document_review", "gguf": "m.gguf",
        "flash_attn": True, "cache_reuse": 256, "llama_cpp_python": "0.3.36", "threads": 2,
    }  # fmt: skip
    summary = serve_peers.speedups(rows) | serve_peers.versus_peers(rows)
    return SuiteResult(suite="serve_peers", info=_info(date), settings=settings, rows=rows, summary=summary)


def test_the_recorded_calls_are_each_workflows_own_in_the_graphs_order(tiny_model_dir):
    request = {
        "graph": "document_review", "graphs": str(GRAPHS), "texts": ["alpha beta gamma " * 20, "one two three " * 20],
        "context": 32, "roles": 2, "max_tokens": 3, "model": tiny_model_dir,
    }  # fmt: skip
    workflows = record(request)["workflows"]
    assert len(workflows) == 2
    for calls in workflows:
        # planner, two specialists, critic, summarizer; every answer but the plan decodes exactly 3 tokens
        assert [c["node"] for c in calls] == ["planner", "specialist", "specialist", "critic", "summarizer"]
        assert [c["output_tokens"] for c in calls[1:]] == [3, 3, 3, 3]
    # each workflow's calls read its own document: the two share no call's prompt
    assert workflows[0][0]["input_ids"] != workflows[1][0]["input_ids"]


class FakeServer:
    """Stands in for llama-server: records when each call arrived, and the slot it named with its first token."""

    def __init__(self, *args, **kwargs) -> None:
        self.command = ["llama-server"]
        self.kwargs = kwargs
        self.arrivals: list[float] = []
        self.slots: list[tuple[int | None, int]] = []
        self.lock = threading.Lock()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def complete(self, input_ids, tokens, slot=None):
        with self.lock:
            self.arrivals.append(time.perf_counter())
            self.slots.append((slot, input_ids[0]))
        time.sleep(0.05)
        return {"timings": {"prompt_n": 1, "predicted_n": tokens}}


def _fake_servers(monkeypatch) -> list[FakeServer]:
    servers: list[FakeServer] = []

    def server(*args, **kwargs):
        servers.append(FakeServer(*args, **kwargs))
        return servers[-1]

    monkeypatch.setattr(serve_peers, "LlamaServer", server)
    monkeypatch.setattr(serve_peers, "server_peak_rss_bytes", lambda _: 123)
    return servers


def _options(**changes) -> serve_peers.ServePeersOptions:
    return serve_peers.ServePeersOptions.model_construct(
        llama_server=Path("llama-server"), gguf=Path("m.gguf"), max_tokens=2, flash_attn=True, cache_reuse=256,
        **changes,
    )  # fmt: skip


def test_the_server_replay_starts_every_workflow_together_and_counts_from_the_common_start(monkeypatch):
    servers, options = _fake_servers(monkeypatch), _options()
    workflows = [[{"node": "planner", "input_ids": [1, 2], "output_tokens": 2}] for _ in range(3)]
    measured = serve_peers.llama_server_at_once(options, workflows)
    assert measured["rss_peak_bytes"] == 123 and len(measured["runs"]) == 3
    # the warm-up, then the three workflows' calls within a moment of each other (not one after another)
    arrivals = servers[0].arrivals[1:]
    assert max(arrivals) - min(arrivals) < 0.04
    assert all(r["output_tokens"] == 2 and 0.05 <= r["latency_s"] <= measured["wall_s"] for r in measured["runs"])


@pytest.mark.parametrize(("pin_slots", "unified_kv"), [(True, True), (False, True), (True, False)])
def test_each_workflow_keeps_its_own_slot_unless_told_otherwise(monkeypatch, pin_slots, unified_kv):
    servers = _fake_servers(monkeypatch)
    workflows = [
        [{"node": "specialist", "input_ids": [100 + w, 1], "output_tokens": 1} for _ in range(3)] for w in range(4)
    ]
    serve_peers.llama_server_at_once(_options(pin_slots=pin_slots, unified_kv=unified_kv), workflows)
    server = servers[0]
    assert server.kwargs["slots"] == 4 and server.kwargs["unified_kv"] is unified_kv
    calls = server.slots[1:]  # after the warm-up
    assert len(calls) == 12
    if pin_slots:  # workflow w (its calls open with token 100 + w) always on slot w: its document stays there
        assert sorted(set(calls)) == [(w, 100 + w) for w in range(4)]
    else:
        assert {slot for slot, _ in calls} == {None}


def test_the_table_compares_ours_at_once_with_each_peer_at_the_same_n(tmp_path):
    result = _result()
    assert result.summary["at_once_vs_llama_server_2_x"] == pytest.approx(1.5)
    assert result.summary["at_once_vs_llamacpp_one_after_another_2_x"] == pytest.approx(3.0)
    assert "llama_server_2_throughput_x" not in result.summary  # a peer is not our "one after another"
    block = serve_peers.readme_block(result)["serve_peers"]
    assert "| 2 | 18.0 / 9.0 | 12.0 | 6.0 | 2.00x / 1.50x / 3.00x | 5.6 s | 1,024 MiB / 512 MiB |" in block
    names = [p.name for p in serve_peers.write_serve_peers(result, tmp_path)]
    assert names == ["serve_peers.json", "serve_peers.md", "serve.json", "serve.md"]
    markdown = (tmp_path / "serve_peers.md").read_text()
    assert "| 2 | llama-server, N slots, at once |" in markdown and "`--cache-reuse 256`" in markdown
    assert "`--kv-unified`, any idle slot taking any call" in markdown  # a run from before the slot settings
    ours = SuiteResult.load(tmp_path / "serve.json")
    assert {r["mode"] for r in ours.rows} == {"at_once", "one_after_another"}


def test_rendering_never_overwrites_a_bench_serve_run_of_its_own(tmp_path):
    serve_peers.write_serve(serve_peers.our_result(_result(date="2026-12-01")), tmp_path)  # another run's files
    before = (tmp_path / "serve.json").read_text()
    names = [p.name for p in serve_peers.write_serve_peers(_result(), tmp_path)]
    assert names == ["serve_peers.json", "serve_peers.md"]
    assert (tmp_path / "serve.json").read_text() == before


def test_serve_peers_without_the_server_says_what_to_pass():
    with pytest.raises(ValueError, match="serve_peers needs --llama-server PATH"):
        serve_peers.ServePeersOptions()
