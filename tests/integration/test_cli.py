"""Smoke tests of the `polykv-agents` command line on the embedded model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from polykv_agents.cli import app

pytestmark = pytest.mark.real_model

runner = CliRunner()


@pytest.fixture
def text_file(tmp_path, sample_document):
    path = tmp_path / "doc.md"
    path.write_text(sample_document, encoding="utf-8")
    return path


def test_eval_ppl_json_has_the_documented_keys(smollm, text_file):
    result = runner.invoke(
        app,
        [
            "eval",
            "ppl",
            "--document",
            str(text_file),
            "--context-tokens",
            "300",
            "--continuation-tokens",
            "64",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    for key in ("ppl_full", "ppl_pool", "delta_pct", "pool_nbytes", "fp16_nbytes", "compression_ratio", "num_tokens"):
        assert key in row
    assert row["num_tokens"] == 300
    assert abs(row["delta_pct"]) < 10
    assert row["compression_ratio"] > 2.5


def test_demo_runs_three_roles_and_prints_the_memory_table(smollm):
    result = runner.invoke(app, ["demo", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    for text in ("finance analyst", "network engineer", "risk officer", "KV memory", "shared pool"):
        assert text in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--value-bits", "7"], "bits=7"),
        (["--key-granularity", "row"], "granularity"),
        (["--context-tokens", "100000"], "context_tokens + continuation_tokens"),
    ],
)
def test_eval_ppl_bad_settings_print_one_error_line(smollm, text_file, args, message):
    result = runner.invoke(app, ["eval", "ppl", "--document", str(text_file), *args])
    assert result.exit_code == 1
    assert "error:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.output


def test_empty_document_is_a_clean_error(smollm, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    result = runner.invoke(app, ["demo", "--document", str(empty)])
    assert result.exit_code == 1
    assert "document is empty" in result.stderr
    assert "Traceback" not in result.output


def test_bench_agents_json_has_the_documented_keys(smollm, text_file):
    result = runner.invoke(
        app,
        [
            "bench", "agents", "--document", str(text_file), "--agents", "3", "--context-tokens", "128",
            "--max-new-tokens", "4", "--repetitions", "1", "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    for key in (
        "kv_bytes_pooled_peak",
        "kv_bytes_naive_peak",
        "throughput_tok_s_batched",
        "throughput_tok_s_sequential",
        "throughput_tok_s_naive_batched",
        "ttft_s_pool",
        "ttft_s_reprefill",
        "rss_peak_bytes",
    ):
        assert row[key] > 0, key
    # Three copies of the decoded prefix cost more than one pool plus one shared decoded prefix.
    assert row["kv_bytes_naive_peak"] > row["kv_bytes_pooled_peak"]
