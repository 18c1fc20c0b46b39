"""The package's suites end to end on a tiny random model: the rows carry what the tables and plots need, and
the measurements relate the way they must (the suites' real figures come from the embedded model, see
docs/RESULTS.md)."""

from __future__ import annotations

import statistics

import pytest

from polykv_agents.bench.memory import run_memory_suite, write_memory
from polykv_agents.bench.quality import run_quality_suite, write_quality
from polykv_agents.bench.speed import run_speed_suite, write_speed
from polykv_agents.config import CodecConfig, CompressionConfig
from polykv_agents.eval.corpus import pydoc_documents


@pytest.fixture(scope="module")
def texts():
    return pydoc_documents(2, chars_per_document=3000)


def test_memory_suite_grows_with_agents_for_separate_caches_only(tiny_model, tiny_tok, texts, tmp_path):
    steps = []
    result = run_memory_suite(
        tiny_model, tiny_tok, texts[0], contexts=(64, 384), agent_counts=(1, 4), new_tokens=2, progress=steps.append
    )
    assert len(steps) == 2 * (1 + 2)
    rows = {(r["context_tokens"], r["agents"]): r for r in result.rows}
    for context in (64, 384):
        one, four = rows[(context, 1)], rows[(context, 4)]
        assert four["kv_bytes_separate_model_dtype"] == 4 * one["kv_bytes_separate_model_dtype"]
        assert four["kv_bytes_separate_fp16"] * 2 == four["kv_bytes_separate_model_dtype"]  # fp32 model
        assert four["peak_batch"] >= 1 and four["rss_peak_ours"] > 0
    # Once the document outweighs the agents' own prompts, one shared prefix beats four copies.
    assert rows[(384, 4)]["kv_bytes_ours_peak"] < rows[(384, 4)]["kv_bytes_separate_model_dtype"]
    assert rows[(384, 4)]["pool_nbytes"] > rows[(64, 4)]["pool_nbytes"]
    # A prefix-sharing engine holds the document once in fp16; our default holds the pool beside its decoded prefix.
    shared = rows[(384, 4)]["kv_bytes_shared_fp16_prefix"]
    assert rows[(384, 4)]["fp16_nbytes"] < shared < rows[(384, 4)]["kv_bytes_ours_peak"]
    names = [p.name for p in write_memory(result, tmp_path)]
    assert names == ["memory.json", "memory.md", "memory_vs_agents.png"]


def test_speed_suite_reports_build_ttft_and_throughput(tiny_model, tiny_tok, texts, tmp_path):
    result = run_speed_suite(
        tiny_model, tiny_tok, texts[0], contexts=(64,), agent_counts=(1, 3), new_tokens=3, repetitions=1
    )
    kinds = [r["kind"] for r in result.rows]
    assert kinds == ["kernel", "kernel", "build", "ttft", "throughput", "throughput"]
    build, ttft = result.rows[2], result.rows[3]
    kernel = {r["shape"]: r for r in result.rows if r["kind"] == "kernel"}
    assert kernel["admission prefill"]["query_tokens_per_agent"] == 40 and kernel["decode step"]["agents"] == 3
    assert all(r["ms_per_layer_fused"] > 0 and r["ms_per_layer_unfused"] > 0 for r in kernel.values())
    assert all(r["ms_per_step"] > 0 for r in result.rows if r["kind"] == "throughput")
    assert build["prefill_s"] > 0 and build["compress_pct_of_prefill"] > 0
    assert ttft["ttft_s_pool_cold"] > 0 and ttft["ttft_s_pool_warm"] > 0 and ttft["ttft_s_reprefill"] > 0
    assert result.rows[4]["speedup_vs_one_agent"] == 1.0
    assert {"compress_within_target", "decompress_within_target"} <= set(result.summary)
    written = write_speed(result, tmp_path)
    assert "TTFT pool, cold s" in written[1].read_text() and written[2].name == "speed_throughput.png"


def test_quality_suite_full_precision_config_agrees_exactly(tiny_model, tiny_tok, texts, tmp_path):
    configs = {
        "full": CompressionConfig.full_precision(),
        "tq2": CompressionConfig(values=CodecConfig(method="turboquant", bits=2)),
    }
    compared = []

    def similarity(predictions, references):  # records what the suite compares; 1.0 for equal answers only
        compared.append(list(zip(predictions, references, strict=True)))
        return [float(p == r) for p, r in zip(predictions, references, strict=True)]

    result = run_quality_suite(
        tiny_model, tiny_tok, texts, contexts=(64, 128), configs=configs, continuation_tokens=32,
        agreement_context=64, max_new_tokens=6, similarity=similarity,
    )  # fmt: skip
    ppl = {(r["config"], r["context_tokens"]): r for r in result.rows if r["kind"] == "ppl"}
    assert ppl[("full", 64)]["delta_pct_mean"] == pytest.approx(0.0, abs=1e-4)
    assert ppl[("tq2", 128)]["documents"] == 2 and len(ppl[("tq2", 128)]["delta_pct_per_document"]) == 2
    agreement = {r["config"]: r for r in result.rows if r["kind"] == "agreement"}
    assert agreement["full"]["exact_match"] == 1.0 and agreement["full"]["token_f1"] == 1.0
    # One comparison per config, each of its pooled answers against the uncompressed cache's answer to the same
    # question: the full-precision pool answers word for word as that cache, so every pair is equal.
    full, tq2 = compared
    assert len(full) == len(tq2) == agreement["tq2"]["answers"] == 2 * 3
    assert all(pooled == reference for pooled, reference in full) and agreement["full"]["minilm_cosine"] == 1.0
    assert [reference for _, reference in tq2] == [reference for _, reference in full]
    assert [(e["pooled"], e["full_precision"]) for e in agreement["tq2"]["examples"]] == tq2[:3]
    assert agreement["tq2"]["minilm_cosine"] == pytest.approx(statistics.fmean(p == r for p, r in tq2))
    assert "MiniLM cosine" in (write_quality(result, tmp_path)[1]).read_text()
