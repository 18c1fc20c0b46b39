"""``python -m benchmarks frontier``: how small a pool can get before perplexity moves, on any model.

Each config is a point (bytes, perplexity delta): the shipped presets, the smaller combinations of the
plain codecs, and the centered TurboQuant codec (attention sinks kept, channel mean removed, 8-bit
norms, keys compressed before RoPE) at 4, 3 and 2 bits. Sizes are the measured ``nbytes`` of real
pools; deltas come from the ablation's protocol (:func:`~benchmarks.studies.ablation.run_ablation_suite`:
one prefill per document and context, every rotation seed, intervals over documents).

The summary names the Pareto frontier (no other config is both smaller and better), and the smallest
config within the bound the project holds a preset to: mean delta <= +1% at every context.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from benchmarks.studies.ablation import MAX_PRESET_BUDGET_PCT, run_ablation_suite
from polykv_agents.bench.configs import CONFIGS
from polykv_agents.bench.output import Column, Progress, SuiteResult, column, write_suite
from polykv_agents.bench.suite import TableSuite, load_model_for
from polykv_agents.bench.sweep import SweepOptions, pct_interval, pct_range

COMMAND = "python -m benchmarks frontier"

TARGET_RATIO = 5.0
"""The compression the frontier is asked to reach within the bound (issue: a pool >= 5x smaller than fp16)."""


class FrontierOptions(SweepOptions):
    contexts: list[int] = Field(default=[2048], json_schema_extra={"flag": "--context"})
    """Context length (repeatable)."""
    seeds: int = Field(default=3, ge=1)
    """Rotation seeds per config."""


def pareto_front(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """Names of the points ``(name, ratio vs fp16, delta)`` that no other point beats on both: at least as
    small a pool with at most the same delta, better in one of the two. Sorted from largest pool to smallest."""
    front = [
        (name, ratio, delta)
        for name, ratio, delta in points
        if not any(r >= ratio and d <= delta and (r > ratio or d < delta) for other, r, d in points if other != name)
    ]
    return [name for name, _, _ in sorted(front, key=lambda p: p[1])]


def summarize(rows: Sequence[dict]) -> dict:
    """Per config: the worst mean delta over contexts and its smallest ratio; the front; the smallest in bound."""
    worst: dict[str, tuple[float, float]] = {}
    for row in rows:
        ratio, delta = worst.get(row["config"], (float("inf"), float("-inf")))
        worst[row["config"]] = (min(ratio, row["compression_ratio_vs_fp16"]), max(delta, row["delta_pct_mean"]))
    within = {name: ratio for name, (ratio, delta) in worst.items() if delta <= MAX_PRESET_BUDGET_PCT}
    smallest = max(within, key=within.get) if within else None
    return {
        "pareto_front": pareto_front([(name, ratio, delta) for name, (ratio, delta) in worst.items()]),
        "budget_pct": MAX_PRESET_BUDGET_PCT,
        "target_ratio": TARGET_RATIO,
        "smallest_within_budget": smallest,
        "smallest_within_budget_ratio": within.get(smallest),
        "target_met": bool(within) and max(within.values()) >= TARGET_RATIO,
    }


def _measure(options: FrontierOptions, progress: Progress) -> SuiteResult:
    from polykv_agents.eval.corpus import pydoc_documents

    texts = pydoc_documents(options.documents)
    model, tokenizer = load_model_for(options.model)
    ablation = run_ablation_suite(
        model,
        tokenizer,
        texts,
        contexts=options.contexts,
        seeds=list(range(options.seeds)),
        factors={name: ("frontier", config) for name, config in CONFIGS.items()},
        progress=progress,
    )
    rows = [{k: v for k, v in row.items() if k != "factor"} for row in ablation.rows]
    return SuiteResult(
        suite="frontier", info=ablation.info, settings=ablation.settings, rows=rows, summary=summarize(rows)
    )


def readme_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's frontier table: each config's size and worst-context delta, and whether it is on the front."""
    summary = result.summary
    front = set(summary["pareto_front"])
    lines = [
        "| config | codecs | x vs fp16 | bits per element | "
        + " | ".join(f"PPL delta at {c:,}, mean [95% CI]" for c in result.settings["contexts"])
        + " | on the front |",
        "|---|---|---:|---:|" + "---:|" * len(result.settings["contexts"]) + "---|",
    ]
    by_config: dict[str, dict[int, dict]] = {}
    for row in result.rows:
        by_config.setdefault(row["config"], {})[row["context_tokens"]] = row
    for name, rows in by_config.items():
        first = rows[result.settings["contexts"][0]]
        cells = " | ".join(pct_interval(rows[c]) for c in result.settings["contexts"])
        ratio = first["compression_ratio_vs_fp16"]
        lines.append(
            f"| {name} | `{first['config_label']}` | {ratio:.2f}x | {16 / ratio:.2f} | {cells} | "
            f"{'yes' if name in front else ''} |"
        )
    smallest = summary["smallest_within_budget"]
    lines += [
        "",
        f"{result.info.model} ({result.info.dtype}), {result.settings['documents']} texts x "
        f"{len(result.settings['seeds'])} rotation seeds (`{COMMAND}`). Smallest within "
        f"+{summary['budget_pct']:.0f}%: "
        + (f"**{smallest}** ({summary['smallest_within_budget_ratio']:.2f}x)" if smallest else "none")
        + f"; >= {summary['target_ratio']:.0f}x within it: {'yes' if summary['target_met'] else 'no'}. "
        + result.info.commit_sentence(),
    ]
    return {"frontier": "\n".join(lines)}


def frontier_plot(rows: Sequence[dict], front: Sequence[str], budget_pct: float, target_ratio: float, model: str):
    """Perplexity delta (mean, 95% CI) against bits per element, one colour per context; the Pareto front joined."""
    from polykv_agents.bench.plots import error_bars, plt

    figure, axis = plt.subplots(figsize=(7.5, 5))
    for index, context in enumerate(sorted({r["context_tokens"] for r in rows})):
        points = [r for r in rows if r["context_tokens"] == context]
        bits = [16 / r["compression_ratio_vs_fp16"] for r in points]
        means = [r["delta_pct_mean"] for r in points]
        errors = error_bars(means, [r["delta_pct_ci_low"] for r in points], [r["delta_pct_ci_high"] for r in points])
        axis.errorbar(bits, means, yerr=errors, fmt="o", color=f"C{index}", capsize=3, label=f"{context} tokens")
        on_front = sorted((16 / r["compression_ratio_vs_fp16"], r["delta_pct_mean"]) for r in points
                          if r["config"] in front)  # fmt: skip
        axis.plot([b for b, _ in on_front], [d for _, d in on_front], "-", color=f"C{index}", alpha=0.6)
        for bit, mean, row in zip(bits, means, points, strict=True):
            if row["config"] in front:  # the others crowd the 3.2-bit column; the table names them
                axis.annotate(row["config_label"], (bit, mean), fontsize=6, xytext=(4, 2), textcoords="offset points")
    axis.axhline(budget_pct, color="C3", linestyle="--", linewidth=0.9, label=f"+{budget_pct:.0f}% bound")
    axis.axvline(16 / target_ratio, color="C2", linestyle=":", linewidth=0.9, label=f"{target_ratio:.0f}x vs fp16")
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_yscale("symlog", linthresh=1)
    axis.set_xlabel("bits per element, measured (16 / ratio vs fp16; scales, norms, sinks included)")
    axis.set_ylabel("perplexity delta vs full precision (%), symlog")
    axis.set_title(f"Compression frontier: pool size against perplexity, {model}")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    return figure


def write_frontier(result: SuiteResult, out_dir: Path) -> list[Path]:
    summary = result.summary
    front = set(summary["pareto_front"])
    columns = [
        column("config", "config"),
        column("codecs", "config_label"),
        column("context", "context_tokens"),
        column("x vs fp16", "compression_ratio_vs_fp16", "{:.2f}"),
        Column("bits per element", lambda r: f"{16 / r['compression_ratio_vs_fp16']:.2f}"),
        Column("PPL delta, mean [95% CI]", pct_interval),
        Column("range", pct_range),
        Column("on the front", lambda r: "yes" if r["config"] in front else ""),
    ]
    budget, target = summary["budget_pct"], summary["target_ratio"]
    smallest = summary["smallest_within_budget"]
    verdict = (
        f"The smallest config whose mean delta is <= +{budget:.0f}% at every context: **{smallest}** "
        f"({summary['smallest_within_budget_ratio']:.2f}x vs fp16)"
        if smallest
        else f"No config's mean delta is within +{budget:.0f}% at every context"
    )
    verdict += (
        f"; a pool >= {target:.0f}x smaller than fp16 within that bound: "
        f"{'found' if summary['target_met'] else 'not found'}."
    )
    notes = [
        verdict,
        "Pareto front (no other config has both a smaller pool and a smaller worst-context delta), "
        f"largest pool first: {', '.join(summary['pareto_front'])}. Bits per element: 16 / (x vs fp16), "
        "scales, norms, means and sink tokens included, all from measured pool bytes.",
    ]
    figures = {"ppl_vs_bytes": frontier_plot(result.rows, summary["pareto_front"], budget, target, result.info.model)}
    return write_suite(result, out_dir, title="Compression frontier", columns=columns, figures=figures, notes=notes)


SUITE = TableSuite(
    "frontier",
    "Pool bytes against perplexity delta: presets, smaller codec combinations, centered TurboQuant; Pareto front.",
    FrontierOptions,
    _measure,
    write_frontier,
    command=COMMAND,
    blocks=readme_blocks,
)
