"""Smoke tests of the `polykv-agents` command line on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import polykv_agents.bench
from polykv_agents.cli.main import app

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
        (["--preset", "tiny"], "unknown compression preset 'tiny'"),
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


def test_bench_agents_json_has_the_documented_keys(smollm, text_file, tmp_path):
    result = runner.invoke(
        app,
        [
            "bench", "agents", "--document", str(text_file), "--agents", "3", "--context-tokens", "128",
            "--max-new-tokens", "4", "--repetitions", "1", "--out", str(tmp_path), "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert json.loads((tmp_path / f"agents_{row['context_tokens']}.json").read_text()) == row  # what render reads
    assert row["kv_bytes_pooled_peak"] > 0
    for method in ("batched_cold", "batched_warm", "sequential", "naive"):
        assert row["throughput_tok_s"][method] > 0 and row["rss_peak_bytes"][method] > 0, method
    # Greedy fp32 on the real model: the naive baseline does the runtime's work, token for token.
    assert row["naive_rows_identical"] == 3
    # Three copies of the decoded prefix cost more than one pool plus one shared decoded prefix.
    assert row["kv_bytes_naive_peak"] > row["kv_bytes_pooled_peak"]


def test_bench_memory_and_speed_write_their_tables_and_plots(smollm, text_file, tmp_path):
    tmp_path = tmp_path / "results"
    common = ["--document", str(text_file), "--context", "64", "--context", "256", "--agents", "1", "--agents", "3"]
    memory = runner.invoke(app, ["bench", "memory", *common, "--out", str(tmp_path)])
    assert memory.exit_code == 0, memory.output
    speed = runner.invoke(
        app, ["bench", "speed", *common, "--new-tokens", "2", "--repetitions", "1", "--out", str(tmp_path)]
    )
    assert speed.exit_code == 0, speed.output
    assert {p.name for p in tmp_path.iterdir()} == {
        "memory.json", "memory.md", "memory_vs_agents.png", "speed.json", "speed.md", "speed_throughput.png",
    }  # fmt: skip
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    (three,) = [r for r in rows if r["agents"] == 3 and r["context_tokens"] == 256]
    # Once the document outweighs the agents' own prompts, one shared prefix beats three copies.
    assert three["kv_bytes_separate_model_dtype"] > three["kv_bytes_ours_peak"]
    assert "SmolLM2-135M-Instruct" in (tmp_path / "speed.md").read_text()


def test_bench_without_its_extras_says_what_to_install(smollm, text_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    # Forget the figures' module, so that it is imported again.
    monkeypatch.delitem(sys.modules, "polykv_agents.bench.plots", raising=False)
    monkeypatch.delattr(polykv_agents.bench, "plots", raising=False)
    result = runner.invoke(app, ["bench", "memory", "--document", str(text_file), "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert 'pip install "polykv-agents[bench]"' in result.stderr
    assert "Traceback" not in result.output


def test_eval_ppl_preset_max_is_smaller_than_the_default(smollm, text_file):
    def ratio(*args: str) -> float:
        base = ["eval", "ppl", "--document", str(text_file), "--context-tokens", "300", "--continuation-tokens", "32"]
        result = runner.invoke(app, [*base, *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["compression_ratio"]

    assert ratio("--preset", "max") > ratio() + 1.0  # centered tq4 keys before RoPE: 4.4x against 2.8x, measured


def test_the_cli_starts_without_the_optional_extras():
    """`pip install -e .` (no bench or ray extra) must be enough for `polykv-agents demo`: the bench commands
    are listed, and their extras are imported only when one of them runs."""
    blocked = ["scipy", "matplotlib", "psutil", "ray"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # importing it now raises ImportError\n"
        "from typer.testing import CliRunner\n"
        "from polykv_agents.cli.main import app\n"
        "result = CliRunner().invoke(app, ['--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "assert 'demo' in result.output and 'bench' in result.output\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
