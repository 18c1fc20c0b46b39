"""The peers suite's glue: the replay sums stages and resets only when asked, the table names the
winner of every measure (a peer where it wins), and the server client checks the work was equal.
The measurements themselves need the [peers] extra; docs/RESULTS.md holds the committed ones."""

from __future__ import annotations

import pytest

from benchmarks.studies import llamacpp_side
from benchmarks.studies.peers_writer import winners_lines, write_peers
from polykv_agents.bench.output import SuiteResult

CALLS = [
    {"node": "planner", "input_ids": [1, 2, 3], "output_tokens": 2},
    {"node": "specialist", "input_ids": [1, 2, 4], "output_tokens": 3},
    {"node": "specialist", "input_ids": [1, 2, 5], "output_tokens": 3},
    {"node": "critic", "input_ids": [1, 2, 6], "output_tokens": 1},
]


class FakeLlama:
    """Records what the replay asks of llama.cpp."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def reset(self) -> None:
        self.events.append(("reset",))

    def generate(self, tokens, reset, **sampling):
        assert sampling["temp"] == 0.0 and reset  # greedy; prefix reuse is generate's own
        self.events.append(("generate", tuple(tokens)))
        while True:
            yield 7


@pytest.mark.parametrize("reset_every_call", [False, True])
def test_the_replay_decodes_each_calls_tokens_in_order_and_resets_only_when_asked(reset_every_call):
    llm = FakeLlama()
    review = llamacpp_side.replay_review(llm, CALLS, reset_every_call)
    generated = [e[1] for e in llm.events if e[0] == "generate"]
    assert generated == [tuple(c["input_ids"]) for c in CALLS]
    assert sum(e == ("reset",) for e in llm.events) == (len(CALLS) if reset_every_call else 0)
    assert review["calls"] == 4 and review["output_tokens"] == 9
    assert set(review["stage_s"]) == {"planner", "specialist", "critic"}
    assert sum(review["stage_s"].values()) <= review["wall_s"]


def test_decode_takes_exactly_the_asked_tokens_past_any_end_of_sequence():
    counted = []

    class Counting(FakeLlama):
        def generate(self, tokens, reset, **sampling):
            for token in super().generate(tokens, reset, **sampling):
                counted.append(token)
                yield token

    first, total = llamacpp_side.decode(Counting(), [1, 2], 5)
    assert len(counted) == 5 and 0 <= first <= total


def _row(context, method, **figures):
    return {"context_tokens": context, "method": method, **figures}


def _sampled(context, method, **samples):
    """A row as the run writes it: the median of each figure and its per-document samples."""
    import statistics

    medians = {key: statistics.median(values) for key, values in samples.items()}
    return {"context_tokens": context, "method": method, **medians, "samples": samples}


def test_the_winners_table_says_where_a_peer_wins_with_per_document_intervals():
    rows = [
        _sampled(2048, "polykv_agents (one pool)", review_wall_s=[20.0, 21.0, 19.0, 20.5, 19.5],
                 decode_tok_s=[14.0, 14.5, 13.5, 14.0, 14.2]),
        _sampled(2048, "llama.cpp, flash off", review_wall_s=[30.0, 31.0, 29.0, 30.0, 31.0],
                 decode_tok_s=[40.0, 41.0, 39.0, 40.0, 40.5]),
        _sampled(2048, "llama.cpp, flash on", review_wall_s=[25.0, 26.0, 24.0, 25.5, 24.5],
                 decode_tok_s=[45.0, 44.0, 46.0, 45.0, 45.5]),
    ]  # fmt: skip
    lines = {line.split(" | ")[1]: line for line in winners_lines(rows)[2:]}
    # 25.0 s (flash on) is the best peer's median: ours is 1.25x faster on every document.
    assert "(llama.cpp, flash on) | polykv_agents, 1.25x [" in lines["review wall"]
    assert "**llama.cpp, flash on**, 3.21x [" in lines["single-stream decode tok/s"]
    assert "TTFT cold" not in lines  # not measured: no row


def test_an_interval_that_holds_one_is_a_tie_and_single_figures_tie_within_five_percent():
    rows = [
        _sampled(2048, "polykv_agents (one pool)", review_wall_s=[20.0, 30.0, 20.0, 30.0, 25.0]),
        _sampled(2048, "llama.cpp", review_wall_s=[30.0, 20.0, 30.0, 20.0, 25.0]),
    ]
    rows[0]["rss_peak_bytes"], rows[1]["rss_peak_bytes"] = 1000, 1040
    lines = {line.split(" | ")[1]: line for line in winners_lines(rows)[2:]}
    assert "| tie (" in lines["review wall"]
    assert "| tie (" in lines["peak RSS"]
    rows[1]["rss_peak_bytes"] = 1100  # 10% apart: a winner
    lines = {line.split(" | ")[1]: line for line in winners_lines(rows)[2:]}
    assert "| polykv_agents, 1.10x |" in lines["peak RSS"]


def test_the_winners_table_compares_the_fixed_defaults_never_our_best_setting_picked_afterwards():
    rows = [
        _sampled(2048, "polykv_agents (one pool)", decode_tok_s=[14.0, 14.0, 15.0]),
        {
            **_sampled(2048, "polykv_agents (one pool), int4 weights", decode_tok_s=[50.0, 51.0, 52.0]),
            "weights": "int4",
        },
        _sampled(2048, "llama.cpp", decode_tok_s=[40.0, 41.0, 40.0]),
    ]
    lines = {line.split(" | ")[1]: line for line in winners_lines(rows)[2:]}
    assert "| 14.0 | 40.0 (llama.cpp) | **llama.cpp**, 2.81x [" in lines["single-stream decode tok/s"]
    assert winners_lines(rows[1:]) == winners_lines([])  # without the defaults' row: nothing compared


def test_compiled_rows_are_added_to_weights_settings_that_are_measured():
    from benchmarks.studies.peers import PeersOptions, our_method

    options = PeersOptions(weights=["native", "int8"], compiled=["int8"])
    assert options.variants() == [("native", False), ("int8", False), ("int8", True)]
    assert our_method("int8", compiled=True) == "polykv_agents (one pool), int8 weights, compiled decode"
    # the defaults (auto) name no weights, and the native weights are named like any other setting
    assert our_method("auto") == "polykv_agents (one pool)" == our_method(PeersOptions().weights[0])
    assert our_method("native") == "polykv_agents (one pool), native weights"
    with pytest.raises(ValueError, match="weights must be 'auto' or one of"):
        PeersOptions(weights=["int3"])
    with pytest.raises(ValueError, match="--compiled int4 needs --weights int4 too"):
        PeersOptions(weights=["native"], compiled=["int4"])


def test_write_peers_writes_its_table_plot_and_the_servers_prompt_cache_line(tmp_path):
    from polykv_agents.bench.environment import RunInfo

    info = RunInfo(
        machine="Linux x86_64", cpu="cpu", cpu_count=2, torch_threads=2, device="cpu", torch="2", transformers="5",
        python="3.11", model="m", dtype="float32", date="2026-12-01",
    )  # fmt: skip
    rows = [
        _row(256, "polykv_agents (one pool)", review_wall_s=10.0, planner_s=5.0, specialist_s=3.0),
        _row(256, "llama-server, 15 slots, prompt cache", review_wall_s=18.0, specialist_s=15.0,
             prompt_tokens_evaluated=5826, prompt_tokens=6820, decode_tok_s_15=3.0),
    ]  # fmt: skip
    settings = {"contexts": [256], "roles": 15, "model_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    result = SuiteResult(suite="peers", info=info, settings=settings, rows=rows, summary={})
    names = [p.name for p in write_peers(result, tmp_path)]
    assert names == ["peers.json", "peers.md", "peers_stages.png"]
    markdown = (tmp_path / "peers.md").read_text()
    assert (
        "15 slots at 256 tokens evaluated 5,826 of 6,820 prompt tokens" in markdown
        and "| 256 | polykv_agents (one pool) | 10.0 s" in markdown
    )
    # llama-server's 15-agent figure says what it includes (a run before every slot was warmed); the formats of
    # the one file are stated.
    assert "| — / 3.0 (incl. 14 document prefills) |" in markdown
    assert "llama.cpp (Q4_1) computes with its weights as stored (Q4_1 for its 210 attention and MLP" in markdown
    assert "computes in float32" in markdown


def test_a_compression_row_of_a_preset_re_decided_since_is_named_by_its_config():
    from benchmarks.studies.peers_writer import compression_method, document_prefills

    assert compression_method("polykv_agents, max preset (K:tq4 V:tq3)") == (
        "polykv_agents, keys tq4, values tq3 (K:tq4 V:tq3; the `max` preset when measured)"
    )
    for unchanged in (
        "polykv_agents, default preset (K:int8/channel V:tq3)",  # today's default: the same config
        "polykv_agents, max preset (K:ctq4/pre-rope V:ctq3)",  # today's max
        "transformers QuantizedCache, quanto, 4-bit",
    ):
        assert compression_method(unchanged) == unchanged
    assert document_prefills({"method": "llama-server, 1 slot, prompt cache", "decode_tok_s_15": 59.5}, 15) == 0
    assert document_prefills({"method": "llama.cpp, prefix reuse", "decode_tok_s_15": 1.0}, 15) == 0


def test_peers_without_their_extra_say_what_to_install_before_measuring(monkeypatch, tmp_path):
    import sys

    from typer.testing import CliRunner

    from benchmarks.__main__ import app

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    result = CliRunner().invoke(app, ["peers", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert 'pip install "polykv-agents[peers]"' in result.stderr and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.parametrize(("cache_types", "expected"), [(None, (1, 1)), (["q8_0", "q4_0"], (8, 2))])
def test_the_llama_cpp_side_opens_its_context_with_the_cache_types_asked(monkeypatch, tmp_path, cache_types, expected):
    import json
    import sys
    import types

    opened = {}

    class RecordingLlama(FakeLlama):
        def __init__(self, **kwargs) -> None:
            super().__init__()
            opened.update(kwargs)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=RecordingLlama))
    request = {"model_path": "m.gguf", "n_ctx": 64, "threads": 2, "flash_attn": True, "cache_types": cache_types,
               "reset_every_call": False}  # fmt: skip
    (tmp_path / "request.json").write_text(json.dumps(request))
    llamacpp_side.main(str(tmp_path / "request.json"), str(tmp_path / "result.json"))
    assert (opened["type_k"], opened["type_v"]) == expected and opened["flash_attn"]
    assert json.loads((tmp_path / "result.json").read_text())["reviews"] == []


def test_a_llama_cpp_row_names_its_cache_only_when_quantized():
    from benchmarks.studies.peers import QUANTIZED_CACHE, llama_cpp_method

    assert llama_cpp_method("Q4_1", True) == "llama.cpp (Q4_1), prefix reuse, flash attention on"
    assert llama_cpp_method("Q4_1", True, QUANTIZED_CACHE).endswith("flash attention on, cache q8_0/q4_0")
