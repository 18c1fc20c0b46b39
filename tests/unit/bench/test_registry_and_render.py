"""Every registered suite is a `polykv-agents bench` command and renders from the committed results; the
rendered docs/RESULTS.md and the docs' generated sections equal the committed ones byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polykv_agents.bench.registry import SUITES
from polykv_agents.bench.render import (
    GENERATED_DOCS,
    blocks_of,
    fill_generated,
    generated_names,
    render_suites,
    results_markdown,
)
from polykv_agents.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
runner = CliRunner()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """Every suite rendered from a copy of the committed results (rendering rewrites Markdown and plots)."""
    results = tmp_path_factory.mktemp("results")
    shutil.copytree(RESULTS, results, dirs_exist_ok=True)
    return render_suites(results)


def _docs() -> list[Path]:
    return [p for pattern in GENERATED_DOCS for p in sorted(ROOT.glob(pattern)) if p.name != "RESULTS.md"]


def test_every_suite_is_a_bench_command_with_its_options():
    listed = runner.invoke(app, ["bench", "--help"], terminal_width=200)
    assert listed.exit_code == 0, listed.output
    for name, suite in SUITES.items():
        assert f" {name} " in listed.output, name
        result = runner.invoke(app, ["bench", name, "--help"], terminal_width=200)
        assert result.exit_code == 0, result.output
        for field_name, field in suite.options.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            assert extra.get("flag", "--" + field_name.replace("_", "-")) in result.output, (name, field_name)
        assert "--out" in result.output and "--json" in result.output


def test_plan_lists_registered_runs_whose_options_parse():
    result = runner.invoke(app, ["bench", "plan"])
    assert result.exit_code == 0, result.output
    runs = [line.split() for line in result.stdout.splitlines()]
    assert {run[0] for run in runs} == {name for name, suite in SUITES.items() if suite.reproduce}
    for name, *arguments in runs:  # every planned argument names an option of its suite
        flags = {
            (f.json_schema_extra or {}).get("flag", "--" + n.replace("_", "-"))  # type: ignore[union-attr]
            for n, f in SUITES[name].options.model_fields.items()
        }
        assert {a for a in arguments if a.startswith("--")} <= flags, name


def test_every_suite_renders_from_the_committed_results(rendered):
    assert set(rendered) == set(SUITES)  # every suite has committed results, and renders them
    for name, suite in rendered.items():
        assert suite.results or suite.blocks, f"{name} renders nothing the docs include"


def test_rendered_results_md_is_byte_identical_to_the_committed_one(rendered):
    committed = (ROOT / "docs" / "RESULTS.md").read_bytes()
    assert results_markdown(rendered).encode("utf-8") == committed


def test_generated_doc_sections_are_current_and_every_block_is_used(rendered):
    blocks = blocks_of(rendered)
    used = []
    for doc in _docs():
        text = doc.read_text(encoding="utf-8")
        assert fill_generated(text, blocks, where=str(doc)) == text, f"{doc}: run python benchmarks/render_results.py"
        used += generated_names(text)
    assert sorted(used) == sorted(blocks), "a rendered block is in no doc, or in several"


def test_fill_generated_replaces_only_the_section_body_and_refuses_unknown_names():
    text = "a\n<!-- BEGIN generated: x -->\nold\n<!-- END generated: x -->\nb\n"
    assert fill_generated(text, {"x": "new\n"}) == "a\n<!-- BEGIN generated: x -->\nnew\n<!-- END generated: x -->\nb\n"
    with pytest.raises(ValueError, match="'x'"):
        fill_generated(text, {"y": "new"})


def test_bench_agents_runs_on_a_tiny_model_and_its_json_renders(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    result = runner.invoke(
        app,
        [
            "bench", "agents", "--model", tiny_model_dir, "--agents", "2", "--context-tokens", "64",
            "--max-new-tokens", "2", "--repetitions", "1", "--out", str(out), "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["agents"] == 2 and row["kv_bytes_naive_peak"] > 0
    methods = {"batched_cold", "batched_warm", "sequential", "naive"}
    assert set(row["throughput_tok_s"]) == set(row["rss_peak_bytes"]) == methods
    assert all(len(row["samples_tok_s"][m]) == 1 and row["rss_peak_bytes"][m] > 0 for m in methods)
    assert row["naive_rows_identical"] == 2  # fp32, greedy: the naive baseline decodes the runtime's tokens
    assert [p.name for p in out.iterdir()] == [f"agents_{row['context_tokens']}.json"]
    rendered = SUITES["agents"].render(out)
    assert rendered is not None and f"| {row['context_tokens']} | decompressed |" in "\n".join(rendered.results)


def test_bad_suite_options_are_one_error_line(tmp_path):
    result = runner.invoke(app, ["bench", "memory", "--document", str(tmp_path / "missing.txt")])
    assert result.exit_code == 1
    assert "error:" in result.stderr and "document" in result.stderr and "Traceback" not in result.output
    # a repeatable option of checked paths: each value checked, one line each
    missing = tmp_path / "earlier" / "tasks.json"
    result = runner.invoke(app, ["bench", "tasks", "--reuse", str(missing), "--reuse", str(missing)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "reuse.0: Path does not point to a file" in result.stderr and "reuse.1" in result.stderr


def test_another_models_results_in_their_own_folder_render_as_a_section_of_their_own(tmp_path):
    shutil.copy(RESULTS / "quality.json", tmp_path / "quality.json")
    (tmp_path / "second-model").mkdir()
    other = json.loads((RESULTS / "quality.json").read_text())
    other["info"]["model"] = "second-model"
    (tmp_path / "second-model" / "quality.json").write_text(json.dumps(other))
    sections = SUITES["quality"].render(tmp_path).results
    headings = [line for line in sections if line.startswith("## ")]
    assert len(headings) == 2 and headings[1].endswith(", second-model")
    their_part = "\n".join(sections[sections.index(headings[1]) :])
    assert "](../benchmarks/results/second-model/quality_ppl_vs_context.png)" in their_part
    assert (tmp_path / "second-model" / "quality.md").exists()
