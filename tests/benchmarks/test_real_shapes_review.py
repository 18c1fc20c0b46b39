"""The real-shapes review probe's own logic: files it needs, the rows it writes into its table, the runs it refuses."""

from __future__ import annotations

import sys

import pytest

from benchmarks.probes import real_shapes_review as probe


def test_a_missing_gguf_file_names_the_command_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path))
    command = r"python -m benchmarks\.real_shapes --model Llama-3\.2-1B .*--gguf Q8_0"
    with pytest.raises(FileNotFoundError, match=command):
        probe.gguf_path("Llama-3.2-1B", "Q8_0")
    made = tmp_path / "real-shapes" / "Llama-3.2-1B-seed0" / "Llama-3.2-1B-Q8_0.gguf"
    made.parent.mkdir(parents=True)
    made.touch()
    assert probe.gguf_path("Llama-3.2-1B", "Q8_0") == made


def _row(method: str, **figures) -> dict:
    return {"context_tokens": 8192, "method": method, "rss_peak_bytes": 3 * 2**30, **figures}


def test_the_table_says_the_weights_are_random_and_shows_what_each_method_measured():
    result = {
        "settings": {"model": "Llama-3.2-1B", "documents": 3, "roles": 15, "max_tokens": 32},
        "provenance": {"git_commit": "4848b2d0123456789"},
        "rows": [
            _row("ours", review_wall_s=66.2, ttft_scratch_s=24.4, ttft_cold_s=0.27, ttft_warm_s=0.26, decode_tok_s=9.5,
                 decode_tok_s_15=42.6, prefill_tok_s=336, kv_bytes_resident=94_500_000),
            _row("llama-server (Q8_0), 1 slot, prompt cache", review_wall_s=300.0, decode_tok_s_15=9.1),
        ],
    }  # fmt: skip
    table = probe.markdown(result)
    assert "random weights: time and memory only" in table and "commit 4848b2d." in table
    ours, server = table.splitlines()[-2:]
    assert ours == "| 8,192 | ours | 66.2 s | 24.40 / 0.27 / 0.26 s | 9.5 / 42.6 | 336 | 90.1 MiB | 3,072 MiB |"
    assert "| — / — / — | — / 9.1 | — | — |" in server  # what the server's probe does not measure


def test_ours_only_refuses_llama_cpp_rows(monkeypatch, tmp_path, capsys):
    argv = ["real_shapes_review", "--ours-only", "--llama-server", "llama-server", "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        probe.main()
    assert "--ours-only measures no llama.cpp row" in capsys.readouterr().err
