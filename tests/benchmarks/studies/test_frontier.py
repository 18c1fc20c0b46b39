"""The frontier study (``python -m benchmarks frontier``): the Pareto front, the bound's verdict, and the suite end
to end on a tiny model."""

from __future__ import annotations

from benchmarks.studies import frontier
from benchmarks.studies.frontier import FrontierOptions, pareto_front, summarize, write_frontier


def _row(config: str, ratio: float, delta: float, context: int = 2048) -> dict:
    return {
        "config": config, "config_label": config, "context_tokens": context, "compression_ratio_vs_fp16": ratio,
        "delta_pct_mean": delta, "delta_pct_ci_low": delta - 0.5, "delta_pct_ci_high": delta + 0.5,
        "delta_pct_min": delta - 0.2, "delta_pct_max": delta + 0.2,
    }  # fmt: skip


def test_the_front_keeps_only_points_no_other_beats_on_both() -> None:
    points = [("big-good", 2.8, 0.3), ("mid-bad", 4.0, 2.0), ("mid-good", 4.3, 0.9), ("small", 5.1, 1.6),
              ("tie-worse", 4.3, 1.0)]  # fmt: skip
    assert pareto_front(points) == ["big-good", "mid-good", "small"]
    assert pareto_front([("one", 4.0, 1.0), ("same", 4.0, 1.0)]) == ["one", "same"]  # equal points beat neither


def test_the_summary_judges_each_config_by_its_worst_context() -> None:
    rows = [_row("a", 2.8, 0.2), _row("a", 2.8, 0.4, 4096), _row("b", 5.2, 0.5), _row("b", 5.2, 1.3, 4096),
            _row("c", 4.4, 0.8), _row("c", 4.4, 0.9, 4096)]  # fmt: skip
    summary = summarize(rows)
    assert summary["smallest_within_budget"] == "c"  # b is within +1% at 2048 only
    assert summary["smallest_within_budget_ratio"] == 4.4
    assert summary["target_met"] is False
    assert summary["pareto_front"] == ["a", "c", "b"]
    assert summarize([_row("b", 5.2, 0.5)])["target_met"] is True


def test_the_suite_runs_every_config_on_a_tiny_model_and_renders(tiny_model_dir, tmp_path, monkeypatch) -> None:
    chosen = {name: frontier.CONFIGS[name] for name in ("default", "keys ctq3 pre-RoPE, values ctq3")}
    monkeypatch.setattr(frontier, "CONFIGS", chosen)
    options = FrontierOptions(contexts=[96], documents=2, seeds=2, model=tiny_model_dir)
    result = frontier.SUITE.run(options, progress=lambda _: None)
    rows = {row["config"]: row for row in result.rows}
    assert set(rows) == set(chosen)
    assert rows["keys ctq3 pre-RoPE, values ctq3"]["sample_count"] == 2 * 2  # documents x seeds
    assert (
        rows["keys ctq3 pre-RoPE, values ctq3"]["compression_ratio_vs_fp16"]
        > rows["default"]["compression_ratio_vs_fp16"]
    )
    assert set(result.summary["pareto_front"]) <= set(chosen)
    names = [path.name for path in write_frontier(result, tmp_path)]
    assert names == ["frontier.json", "frontier.md", "frontier_ppl_vs_bytes.png"]
    assert "Pareto front" in (tmp_path / "frontier.md").read_text()


def test_the_readme_block_lists_every_config_with_its_worst_and_the_verdict() -> None:
    from benchmarks.studies.frontier import readme_blocks
    from polykv_agents.bench.environment import RunInfo
    from polykv_agents.bench.output import SuiteResult

    rows = [_row("a", 2.8, 0.2), _row("c", 4.4, 0.9), _row("b", 5.2, 1.3)]
    info = RunInfo.model_construct(model="M", dtype="bfloat16")
    result = SuiteResult(suite="frontier", info=info, settings={"contexts": [2048], "documents": 5, "seeds": [0, 1]},
                         rows=rows, summary=summarize(rows))  # fmt: skip
    block = readme_blocks(result)["frontier"]
    assert [line.split(" | ")[0] for line in block.splitlines()[2:5]] == ["| a", "| c", "| b"]
    assert "| b | `b` | 5.20x | 3.08 | +1.30% [+0.80, +1.80] | yes |" in block
    assert "Smallest within +1%: **c** (4.40x); >= 5x within it: no." in block
