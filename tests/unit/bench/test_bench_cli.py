"""`polykv-agents bench`: a command for each of the package's suites (and none of the repository's studies), its
plan, a suite run end to end on a tiny model, bad options as one error line, another model's results rendered."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from suite_commands import assert_every_suite_is_a_command, assert_plan_parses
from typer.testing import CliRunner

from polykv_agents.bench.registry import SUITES
from polykv_agents.cli.main import app
from polykv_agents.model.int8_tiles import vectors_available

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
runner = CliRunner()


def test_every_package_suite_is_a_bench_command_with_its_options_and_no_study_is():
    listed = assert_every_suite_is_a_command(app, ["bench"], SUITES)
    assert list(SUITES) == ["memory", "quality", "tasks", "speed", "agents", "serve"]
    for study in ("ablation", "peers", "graph_e2e"):  # the repository's: `python -m benchmarks <name>`
        assert f" {study} " not in listed
        assert runner.invoke(app, ["bench", study, "--help"]).exit_code != 0


def test_plan_lists_registered_runs_whose_options_parse():
    assert_plan_parses(app, ["bench"], SUITES)


def test_bench_agents_runs_on_a_tiny_model_and_its_json_renders(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    arguments = [
        "bench", "agents", "--model", tiny_model_dir, "--agents", "2", "--context-tokens", "64",
        "--max-new-tokens", "2", "--repetitions", "1", "--out", str(out), "--json",
    ]  # fmt: skip
    result = runner.invoke(app, arguments)
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["agents"] == 2 and row["kv_bytes_naive_peak"] > 0
    methods = {"batched_cold", "batched_warm", "sequential", "naive"}
    assert set(row["throughput_tok_s"]) == set(row["rss_peak_bytes"]) == methods
    assert all(len(row["samples_tok_s"][m]) == 1 and row["rss_peak_bytes"][m] > 0 for m in methods)
    assert row["naive_rows_identical"] == 2  # fp32, greedy: the naive baseline decodes the runtime's tokens
    assert [p.name for p in out.iterdir()] == [f"agents_{row['context_tokens']}.json"]  # the defaults' file
    # an fp32 tiny model: auto keeps the decoded prefix (the tile kernels take bf16), and int8 weights where the int8
    # kernel's vector path runs (AVX-512 or AVX2), the native ones elsewhere
    weights = "int8" if vectors_available() else "native"
    assert (row["runtime"], row["weights"], row["defaults"]) == ("decompressed", weights, True)
    rendered = SUITES["agents"].render(out)
    assert rendered is not None and f"| {row['context_tokens']} | decompressed | {weights} (default) |" in "\n".join(
        rendered.results
    )
    assert "agents" in rendered.blocks  # the README's table: the defaults' rows
    named = ["--runtime", "compressed", "--weights", "int8"]
    result = runner.invoke(app, [*arguments, *named])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert (row["runtime"], row["weights"], row["defaults"]) == ("compressed", "int8", False)
    assert (out / f"agents_compressed_int8_{row['context_tokens']}.json").exists()


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


def test_bench_serve_runs_workflows_at_once_and_one_after_another_with_equal_work(tiny_model_dir, tmp_path):
    """Two reviews over two documents, each mode in a fresh process, on the tiny checkpoint."""
    out = tmp_path / "results"
    graphs = Path(__file__).resolve().parents[3] / "langgraph.json"
    result = runner.invoke(
        app,
        [
            "bench", "serve", "--model", tiny_model_dir, "--workflows", "2", "--mode", "at_once",
            "--mode", "one_after_another", "--context", "48", "--roles", "2", "--max-tokens", "3",
            "--graphs", str(graphs), "--out", str(out), "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [(r["workflows"], r["mode"]) for r in rows] == [(2, "at_once"), (2, "one_after_another")]
    # planner, 2 specialists, critic, summarizer: 3 tokens each but the planner's (its grammar closes the plan)
    assert all(len(r["runs"]) == 2 and r["output_tokens"] > 2 * 4 * 3 for r in rows)
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"]  # the same work in both modes
    assert all(r["rss_peak_bytes"] > 0 and r["latency_p95_s"] >= r["latency_p50_s"] > 0 for r in rows)
    rendered = SUITES["serve"].render(out)
    assert rendered is not None and "| 2 | in process, at once |" in "\n".join(rendered.results)


def test_a_switch_that_defaults_to_on_can_be_turned_off(tmp_path):
    """Every bool option is a pair, ``--x/--no-x`` (``python -m benchmarks peers --reset-baseline`` could not be
    turned off)."""
    import typer

    from polykv_agents.bench.suite import SuiteOptions
    from polykv_agents.cli.bench import suite_command

    class Options(SuiteOptions):
        reset_baseline: bool = True
        """A switch on by default."""

    seen = []

    class Switches:
        name, summary, options, reproduce = "switches", "A suite of one switch.", Options, ((),)

        def run(self, options, progress):
            seen.append(options.reset_baseline)
            return options

        def write(self, result, out_dir):
            return []

    switches = typer.Typer()
    switches.command("switches")(suite_command(Switches()))
    switches.command("other")(lambda: None)  # two commands: typer keeps the name
    for arguments, expected in (([], True), (["--no-reset-baseline"], False), (["--reset-baseline"], True)):
        result = runner.invoke(switches, ["switches", *arguments, "--out", str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert seen.pop() is expected
