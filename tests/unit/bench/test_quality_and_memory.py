"""``bench quality``'s ``--config`` and the README tables the quality and memory suites render."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from polykv_agents.bench import memory, quality
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import SuiteResult
from polykv_agents.bench.quality import QualityOptions


def test_quality_configs_are_presets_or_frontier_configs_in_order_without_the_reference():
    assert QualityOptions().configs == ["default", "paper", "max"]
    assert QualityOptions(configs=["max", "full", "keys tq4, values tq3", "max"]).configs == [
        "max",
        "keys tq4, values tq3",
    ]
    with pytest.raises(ValidationError, match=r"unknown compression config\(s\) \['tiny'\]; choose among the presets"):
        QualityOptions(configs=["default", "tiny"])
    with pytest.raises(ValidationError, match="no compressed config to compare with full precision; choose among"):
        QualityOptions(configs=["full"])


def test_the_quality_suite_measures_the_configs_it_is_given(tiny_model_dir, monkeypatch):
    from polykv_agents.eval import embeddings

    monkeypatch.setattr(embeddings, "minilm_similarity", lambda: lambda a, b: [1.0] * len(a))
    options = QualityOptions(
        contexts=[64], documents=1, configs=["keys tq4, values tq3"], agreement_context=96, model=tiny_model_dir
    )
    result = quality.SUITE.run(options, progress=lambda _: None)
    assert {(row["kind"], row["config"], row["config_label"]) for row in result.rows} == {
        ("ppl", "keys tq4, values tq3", "K:tq4 V:tq3"),
        ("agreement", "keys tq4, values tq3", "K:tq4 V:tq3"),
    }
    assert result.settings["agreement_context"] == 96


def test_held_out_texts_start_at_the_first_document_and_the_result_says_so(tiny_model_dir, monkeypatch, tmp_path):
    from polykv_agents.eval import embeddings
    from polykv_agents.eval.corpus import pydoc_documents

    monkeypatch.setattr(embeddings, "minilm_similarity", lambda: lambda a, b: [1.0] * len(a))
    measure, measured = quality.run_quality_suite, []
    monkeypatch.setattr(quality, "run_quality_suite", lambda *a, **kw: measured.append(a[2]) or measure(*a, **kw))
    options = QualityOptions(contexts=[64], documents=2, first_document=5, configs=["max"], agreement_context=64,
                             model=tiny_model_dir)  # fmt: skip
    result = quality.SUITE.run(options, progress=lambda _: None)
    assert measured == [pydoc_documents(7)[5:]]
    assert result.settings["first_document"] == 5 and result.settings["documents"] == 2
    quality.write_quality(result, tmp_path)
    assert (tmp_path / "quality.md").read_text().startswith("### Quality, held-out texts 5-6\n")


def _info() -> RunInfo:
    return RunInfo.model_construct(model="M", dtype="bfloat16")


def test_the_readme_quality_table_has_a_column_per_config_and_a_row_per_context():
    def ppl(config: str, label: str, context: int, ratio: float, delta: float) -> dict:
        return {
            "kind": "ppl", "config": config, "config_label": label, "context_tokens": context,
            "compression_ratio_vs_fp16": ratio, "delta_pct_mean": delta, "delta_pct_ci_low": delta - 1,
            "delta_pct_ci_high": delta + 1,
        }  # fmt: skip

    rows = [ppl("default", "K:int8 V:tq3", 600, 2.84, 0.1), ppl("max", "K:ctq4 V:ctq3", 600, 4.31, 0.9),
            ppl("default", "K:int8 V:tq3", 2048, 2.84, 0.2), ppl("max", "K:ctq4 V:ctq3", 2048, 4.36, 0.8),
            {"kind": "agreement", "config": "default", "config_label": "", "context_tokens": 2048}]  # fmt: skip
    settings = {"contexts": [600, 2048], "documents": 5, "continuation_tokens": 512}
    table = quality.readme_blocks(SuiteResult(suite="quality", info=_info(), settings=settings, rows=rows))["quality"]
    lines = table.splitlines()
    assert lines[0] == "| context tokens | default (K:int8 V:tq3) | max (K:ctq4 V:ctq3) |"
    assert lines[2] == "| 600 | 2.84x, +0.10% [-0.90, +1.10] | 4.31x, +0.90% [-0.10, +1.90] |"
    assert lines[3] == "| 2,048 | 2.84x, +0.20% [-0.80, +1.20] | 4.36x, +0.80% [-0.20, +1.80] |"
    assert "mean over 5 disjoint texts" in table and "M, bfloat16" in table


def test_the_readme_memory_table_shows_the_most_agents_measured():
    def row(context: int, agents: int) -> dict:
        return {
            "context_tokens": context, "agents": agents, "pool_nbytes": 2**20, "fp16_nbytes": 3 * 2**20,
            "kv_bytes_ours_peak": agents * 2**20, "kv_bytes_separate_model_dtype": 10 * agents * 2**20,
            "kv_bytes_shared_fp16_prefix": (3 + agents) * 2**20,
        }  # fmt: skip

    rows = [row(600, 1), row(600, 15), row(2048, 1), row(2048, 15)]
    result = SuiteResult(suite="memory", info=_info(), settings={"config": "K:int8 V:tq3"}, rows=rows)
    lines = memory.readme_blocks(result)["memory"].splitlines()
    assert lines[0].endswith("| KV with 15 agents at once: ours vs one shared fp16 prefix vs a cache each |")
    assert "pool (K:int8 V:tq3)" in lines[0]
    assert lines[2:] == [
        "| 600 | 1.00 MiB | 3.00x | 15.0 vs 18.0 vs 150.0 MiB |",
        "| 2,048 | 1.00 MiB | 3.00x | 15.0 vs 18.0 vs 150.0 MiB |",
    ]
