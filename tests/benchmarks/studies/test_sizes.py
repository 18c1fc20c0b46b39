"""The sizes study's own logic: the files it needs, its table and the issue's comparisons, the rows it borrows from
an earlier run and the runs it refuses. (The measuring itself is the peers' side processes, tested with them.)"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from benchmarks.studies import peers, sizes
from benchmarks.studies.sizes import SizesOptions, SizesResult
from polykv_agents.bench.provenance import Provenance

MIB = 2**20


def test_a_missing_gguf_file_names_the_command_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path))
    command = r"python -m benchmarks\.real_shapes --model Llama-3\.2-1B .*--gguf Q8_0"
    with pytest.raises(FileNotFoundError, match=command):
        sizes.gguf_path("Llama-3.2-1B", "Q8_0")
    made = tmp_path / "real-shapes" / "Llama-3.2-1B-seed0" / "Llama-3.2-1B-Q8_0.gguf"
    made.parent.mkdir(parents=True)
    made.touch()
    assert sizes.gguf_path("Llama-3.2-1B", "Q8_0") == made


def _row(method: str, walls: list[float], **figures) -> dict:
    return {
        "context_tokens": 8192, "method": method, "review_wall_s": sorted(walls)[1],
        "samples": {"review_wall_s": walls}, "review_calls": 18, "review_output_tokens": [684, 684, 684],
        "rss_peak_bytes": 3 * 2**30, **figures,
    }  # fmt: skip


def _ours(**figures) -> dict:
    return _row("polykv_agents (one pool)", [65.0, 67.0, 70.0], weights="int8", kv_bytes=90 * MIB,
                kv_bytes_resident=90 * MIB, **figures)  # fmt: skip


def _result(rows: list[dict], peers_commit: str | None = None) -> SizesResult:
    settings = {"model": "Llama-3.2-1B", "contexts": [8192], "documents": 3, "roles": 15, "max_tokens": 32,
                "threads": 2, "peers_from": "earlier.json"}  # fmt: skip
    peers = None if peers_commit is None else Provenance(git_commit=peers_commit)
    return SizesResult(provenance=Provenance(git_commit="0123456abc"), peers_provenance=peers, settings=settings,
                       rows=rows)  # fmt: skip


def test_the_table_says_the_weights_are_random_and_which_commit_made_each_side():
    rows = [
        _ours(ttft_scratch_s=24.4, ttft_cold_s=0.27, ttft_warm_s=0.26, decode_tok_s=9.5, decode_tok_s_15=42.6,
              prefill_tok_s=336),
        _row("llama-server (Q8_0), 1 slot, prompt cache", [300.0, 310.0, 320.0], decode_tok_s_15=9.1,
             gguf_format="Q8_0"),
    ]  # fmt: skip
    table = sizes.markdown(_result(rows, peers_commit="4848b2d99"))
    assert "random weights: time and memory only" in table
    assert "our rows and llama-server's at commit 0123456, llama-cpp-python's at 4848b2d (`earlier.json`" in table
    rows[1]["borrowed"] = True  # the server's row from the earlier run too
    assert "our rows at commit 0123456, llama-cpp-python's at 4848b2d" in sizes.markdown(_result(rows, "4848b2d99"))
    ours, server = [line for line in table.splitlines() if line.startswith("| 8,192")]
    assert ours == (
        "| 8,192 | polykv_agents (one pool), int8 weights | 67.0 s | 24.40 / 0.27 / 0.26 s | 9.5 / 42.6 | 336 "
        "| 90.0 MiB | 3,072 / — MiB |"
    )
    assert "| — / — / — | — / 9.1 | — | — |" in server  # what the server's probe does not measure
    assert "commit 0123456." in sizes.markdown(_result(rows))  # one run: one commit


def test_the_comparisons_take_each_document_against_the_fastest_peer_and_say_whether_a_target_is_met():
    rows = [
        _ours(rss_peak_bytes=3190 * MIB),
        _row("llama.cpp (Q8_0)", [340.0, 350.0, 360.0], gguf_format="Q8_0", cache_types=["f16", "f16"],
             kv_bytes_resident=256 * MIB),
        _row("llama.cpp (Q4_0)", [260.0, 335.0, 315.0], gguf_format="Q4_0", cache_types=["f16", "f16"],
             kv_bytes_resident=256 * MIB),
        _row("llama.cpp (Q8_0), cache q8_0/q8_0", [400.0, 410.0, 420.0], gguf_format="Q8_0",
             cache_types=["q8_0", "q8_0"], kv_bytes_resident=136 * MIB),
        _row("llama-server (Q8_0), 1 slot, prompt cache", [500.0, 510.0, 520.0], gguf_format="Q8_0",
             rss_peak_bytes=3100 * MIB),
    ]  # fmt: skip
    review, kv, rss, smallest = sizes.comparisons(rows)
    # Q4_0 has the lowest median (315 s): per document 260/65, 335/67, 315/70.
    assert "llama.cpp (Q4_0), the fastest peer, took 4.0-5.0x ours on each of 3 documents" in review
    assert "90.0 MiB against 136.0 MiB with llama.cpp's q8_0/q8_0 cache (0.66x; target <= 1: met)" in kv
    assert "ours 3,190 MiB (the process) against llama-server's 3,100 MiB plus the pool's 90.0 (target: met)" in rss
    # llama-cpp-python's processes (3,072 MiB) peak below ours: the comparisons say so beside the target.
    assert smallest == "- 8,192 tokens, **the smallest process**: llama.cpp (Q8_0), 3,072 MiB at its peak, below ours."
    rows[0]["rss_peak_bytes"] = 3191 * MIB  # 1 MiB over the server plus the pool
    assert sizes.comparisons(rows)[2].endswith("(target: not met).")
    rows[0]["rss_peak_review_bytes"] = 3000 * MIB  # the process without the probe's extra caches: what is compared
    assert "ours 3,000 MiB (the load and the reviews)" in sizes.comparisons(rows)[2]
    assert len(sizes.comparisons(rows)) == 3  # no process below ours: no fourth line
    assert sizes.comparisons(rows[:1]) == ["- 8,192 tokens: no llama.cpp row."]
    without_server = sizes.comparisons(rows[:4])[2]  # llama-cpp-python's processes peak at 3,072 MiB
    assert (
        "no llama-server row, the target's peer; ours 3,000 MiB (the load and the reviews) against 3,072-3,072 MiB"
        in (without_server)
    )
    assert without_server.endswith("(below every one of them).")
    rows[0]["rss_peak_review_bytes"] = 3073 * MIB
    assert sizes.comparisons(rows[:4])[2].endswith("(llama.cpp holds less).")


def _earlier(tmp_path, rows: list[dict], **settings) -> object:
    result = _result(rows)
    result.settings.update(settings)
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(result.model_dump(mode="json")))
    return path


def test_borrowed_rows_must_come_from_the_same_protocol_and_the_same_work(tmp_path):
    peer = _row("llama.cpp (Q4_0)", [300.0, 310.0, 320.0], gguf_format="Q4_0")
    ours = [_ours()]
    settings = {"model": "Llama-3.2-1B", "contexts": [8192], "documents": 3, "roles": 15, "max_tokens": 32}
    rows, provenance = sizes.borrowed_peers(_earlier(tmp_path, [_ours(), peer]), settings, ours)
    assert rows == [peer | {"borrowed": True}] and provenance.git_commit == "0123456abc"  # not the earlier ours
    server = _row("llama-server (Q8_0), 1 slot, prompt cache", [500.0, 510.0, 520.0], gguf_format="Q8_0")
    earlier = _earlier(tmp_path, [peer, server])
    assert len(sizes.borrowed_peers(earlier, settings, ours)[0]) == 2
    rows, _ = sizes.borrowed_peers(earlier, settings, ours, server_measured=True)  # this run has its own
    assert [row["method"] for row in rows] == ["llama.cpp (Q4_0)"]
    with pytest.raises(ValueError, match="ran other settings \\(documents\\)"):
        sizes.borrowed_peers(_earlier(tmp_path, [peer], documents=5), settings, ours)
    other_work = {**peer, "review_output_tokens": [684, 684, 652]}
    with pytest.raises(ValueError, match="did other work than ours"):
        sizes.borrowed_peers(_earlier(tmp_path, [other_work]), settings, ours)


def test_options_refuse_what_cannot_run(tmp_path):
    with pytest.raises(ValidationError, match=r"none of benchmarks/real_shapes\.py's models"):
        SizesOptions(model="Llama-9B")
    with pytest.raises(ValidationError, match="is not one of"):
        SizesOptions(gguf=["Q5_K"])
    earlier, server = tmp_path / "earlier.json", tmp_path / "llama-server"
    earlier.write_text("{}")
    server.touch()
    with pytest.raises(ValidationError, match=r"--peers-from takes llama-cpp-python's rows .*drop --quantized-cache"):
        SizesOptions(peers_from=earlier, quantized_cache=True)
    assert SizesOptions(peers_from=earlier, llama_server=server).llama_server == server  # a server row measured now


def test_the_docs_show_every_run_and_name_both_sides_commits(tmp_path):
    assert sizes.render(tmp_path) is None  # no run: no section
    rows = [_ours(), _row("llama.cpp (Q4_0)", [300.0, 310.0, 320.0], gguf_format="Q4_0")]
    sizes.SUITE.write(_result(rows, peers_commit="4848b2d99"), tmp_path)
    assert (tmp_path / "sizes" / "Llama-3.2-1B_8192.md").is_file()
    rendered = sizes.render(tmp_path)
    assert rendered is not None and "### Llama-3.2-1B at 8,192 tokens" in rendered.results
    assert [p.git_commit for p in rendered.provenance] == ["0123456abc"]
    assert [p.git_commit for p in rendered.parts["peers"]] == ["4848b2d99"]
    assert rendered.blocks["sizes"].startswith("Llama-3.2-1B (published shapes, **random weights")


def test_the_review_peak_leaves_out_only_the_probe():
    stages = {"load": 2000 * MIB, "warm_up": 2100 * MIB, "reviews": 2500 * MIB, "probes": 3000 * MIB}
    assert peers.review_peak(stages) == 2500 * MIB


def test_our_side_runs_the_review_and_the_probe_on_a_model_folder_with_each_stage_s_peak(
    long_context_model_dir, monkeypatch
):
    """The side process's code in this process, on a local model folder (as a real-shapes model is given)."""
    from benchmarks.studies import graph_e2e, ours_side
    from benchmarks.studies.workflows import LANGGRAPH_JSON, load_workflow
    from polykv_agents.eval.corpus import pydoc_documents

    workflow = load_workflow("document_review", LANGGRAPH_JSON)
    roles = list(workflow.ROLE_PROMPTS)[:3]
    request = {
        "model": long_context_model_dir, "weights": "native", "compiled": False, "graphs": str(LANGGRAPH_JSON),
        "max_tokens": 2, "roles": roles, "context": 300, "texts": pydoc_documents(2, chars_per_document=3000),
    }  # fmt: skip
    order: list[str] = []
    run_graph, probe = graph_e2e.run_graph, ours_side.probe
    monkeypatch.setattr(graph_e2e, "run_graph", lambda *a, **k: order.append("review") or run_graph(*a, **k))
    monkeypatch.setattr(ours_side, "probe", lambda *a, **k: order.append("probe") or probe(*a, **k))
    result = ours_side.measure(request)
    # The warm-up, then every review before any probe: the reviews' peak is a review process's alone.
    assert order == ["review", "review", "review", "probe", "probe"]
    assert [review["calls"] for review in result["reviews"]] == [6, 6]  # planner, 3 specialists, critic, summary
    assert all(len(call["input_ids"]) > 300 for replay in result["replays"] for call in replay)  # the document read
    assert len(result["probe_ids"][0]["document_ids"]) > 300  # the probe's pool holds the same document
    stages = result["rss_stage_peak_bytes"]
    assert list(stages) == ["load", "warm_up", "reviews", "probes"]
    assert result["rss_peak_bytes"] == max(stages.values()) >= result["rss_after_load_bytes"]
    assert result["load_s"] > 0 and result["weights"] == "native"


def test_our_row_takes_the_side_s_figures_and_its_review_peak_without_the_probe(monkeypatch):
    """``peers.our_row``: a side process's result (here given, not run) made into our row."""
    review = {"wall_s": 70.0, "stage_s": {"planner": 10.0}, "calls": 18, "output_tokens": 684}
    side = {
        "reviews": [review, {**review, "wall_s": 72.0}], "replays": [[{"input_ids": [1, 2, 3]}], [{"input_ids": [4]}]],
        "probes": [{"decode_tok_s": 7.0}, {"decode_tok_s": 9.0}], "weights": "int8", "warm_up_s": 15.0, "load_s": 11.0,
        "rss_peak_bytes": 3500 * MIB, "rss_after_load_bytes": 1700 * MIB,
        "rss_stage_peak_bytes": {"load": 2400 * MIB, "reviews": 3000 * MIB, "probes": 3500 * MIB},
    }  # fmt: skip
    monkeypatch.setattr(peers, "run_side_kept", lambda *args, **kwargs: side)
    row, returned = peers.our_row({"context": 8192, "compiled": False}, "polykv_agents (one pool)", None)
    assert returned is side
    assert row["rss_peak_review_bytes"] == 3000 * MIB and row["rss_peak_bytes"] == 3500 * MIB
    assert row["review_wall_s"] == 71.0 and row["decode_tok_s"] == 8.0  # medians over the documents
    assert row["samples"]["review_input_tokens"] == [3, 1]
    assert row["review_calls"] == 18 and row["load_s"] == 11.0 and row["weights"] == "int8"
