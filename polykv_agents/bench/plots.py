"""The suites' figures (matplotlib, drawn off-screen). Each function takes a suite's rows and returns
a figure; :func:`polykv_agents.bench.output.write_suite` saves and closes it."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt

MIB = 2**20


def _errors(means: Sequence[float], lows: Sequence[float], highs: Sequence[float]) -> list[list[float]]:
    """An interval per point as matplotlib's asymmetric error bars: distances below and above each mean."""
    return [
        [m - low for m, low in zip(means, lows, strict=True)],
        [high - m for m, high in zip(means, highs, strict=True)],
    ]


def memory_vs_agents(rows: Sequence[dict]):
    """KV MiB against agents: one colour per context, the runtime solid, separate caches dashed."""
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for index, context in enumerate(sorted({r["context_tokens"] for r in rows})):
        points = sorted((r for r in rows if r["context_tokens"] == context), key=lambda r: r["agents"])
        agents = [r["agents"] for r in points]
        colour = f"C{index}"
        axis.plot(agents, [r["kv_bytes_ours_peak"] / MIB for r in points], "o-", color=colour,
                  label=f"{context} tokens: one pool + shared prefix")  # fmt: skip
        axis.plot(agents, [r["kv_bytes_separate_model_dtype"] / MIB for r in points], "s--", color=colour,
                  alpha=0.6, label=f"{context} tokens: separate caches")  # fmt: skip
    axis.set_yscale("log")
    axis.set_xlabel("agents reading the document at once")
    axis.set_ylabel("peak KV memory (MiB, log scale)")
    axis.set_title("KV memory: one shared pool vs a cache per agent")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    return figure


def ppl_delta_vs_context(rows: Sequence[dict], model: str):
    """Mean perplexity delta against context length, one line per config, range shaded."""
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for index, config in enumerate(dict.fromkeys(r["config"] for r in rows)):
        points = sorted((r for r in rows if r["config"] == config), key=lambda r: r["context_tokens"])
        contexts = [r["context_tokens"] for r in points]
        label = f"{config} ({points[0]['config_label']}, {points[0]['compression_ratio_vs_fp16']:.2f}x)"
        axis.plot(contexts, [r["delta_pct_mean"] for r in points], "o-", color=f"C{index}", label=label)
        axis.fill_between(contexts, [r["delta_pct_min"] for r in points], [r["delta_pct_max"] for r in points],
                          color=f"C{index}", alpha=0.15)  # fmt: skip
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xticks(sorted({r["context_tokens"] for r in rows}))
    axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # only the measured lengths
    axis.set_xlabel("context tokens in the pool")
    axis.set_ylabel("perplexity delta vs full precision (%)")
    axis.set_title(f"Perplexity cost of compression: {model}\n(mean; shaded: min..max over documents)")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    return figure


def throughput_vs_agents(rows: Sequence[dict]):
    figure, axis = plt.subplots(figsize=(6, 4))
    points = sorted(rows, key=lambda r: r["agents"])
    axis.plot([r["agents"] for r in points], [r["tokens_per_s"] for r in points], "o-")
    axis.set_xlabel("agents decoding at once")
    axis.set_ylabel("aggregate tokens/s")
    axis.set_title(f"Batched decoding over one shared {points[0]['context_tokens']}-token prefix")
    axis.grid(True, alpha=0.3)
    return figure


def ablation_deltas(rows: Sequence[dict], context: int):
    """Horizontal bars: mean delta with its 95% interval per config, at one context length."""
    points = [r for r in rows if r["context_tokens"] == context]
    figure, axis = plt.subplots(figsize=(7, 0.45 * len(points) + 1.2))
    labels = [f"{r['config']} ({r['compression_ratio_vs_fp16']:.2f}x)" for r in points]
    means = [r["delta_pct_mean"] for r in points]
    errors = _errors(means, [r["delta_pct_ci_low"] for r in points], [r["delta_pct_ci_high"] for r in points])
    axis.barh(labels, means, xerr=errors, color="C0", alpha=0.7, capsize=3)
    axis.axvline(0, color="black", linewidth=0.8)
    axis.set_xscale("symlog", linthresh=1)
    axis.invert_yaxis()
    axis.set_xlabel("perplexity delta vs full precision (%), mean and 95% CI (symlog)")
    axis.set_title(f"Ablation at {context} tokens")
    axis.grid(True, axis="x", alpha=0.3)
    return figure


def frontier(rows: Sequence[dict], front: Sequence[str], budget_pct: float, target_ratio: float, model: str):
    """Perplexity delta (mean, 95% CI) against bits per element, one colour per context; the Pareto front joined."""
    figure, axis = plt.subplots(figsize=(7.5, 5))
    for index, context in enumerate(sorted({r["context_tokens"] for r in rows})):
        points = [r for r in rows if r["context_tokens"] == context]
        bits = [16 / r["compression_ratio_vs_fp16"] for r in points]
        means = [r["delta_pct_mean"] for r in points]
        errors = _errors(means, [r["delta_pct_ci_low"] for r in points], [r["delta_pct_ci_high"] for r in points])
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


CONFIG_MARKERS = "osD^vP*Xph<>"
"""One hollow marker per config, so that configs of the same size (``default`` and ``paper``) stay apart."""


def task_score_vs_bytes(rows: Sequence[dict], model: str):
    """Task score (mean, 95% CI over items) against measured bits per element: one colour per context, one
    marker per config (two legends beside the axes: points of equal size would bury name labels)."""
    from matplotlib.lines import Line2D

    figure, axis = plt.subplots(figsize=(9, 4.5))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    marker = {config: CONFIG_MARKERS[index % len(CONFIG_MARKERS)] for index, config in enumerate(configs)}
    for index, context in enumerate(sorted({r["context"] for r in rows})):
        colour = f"C{index}"
        points = sorted((r for r in rows if r["context"] == context), key=lambda r: -r["ratio"])
        axis.plot([16 / r["ratio"] for r in points], [r["score"]["mean"] for r in points], "-", color=colour,
                  alpha=0.6, label=f"{context:,} tokens")  # fmt: skip
        for row in points:
            mean, low, high = (row["score"][key] for key in ("mean", "low", "high"))
            axis.errorbar([16 / row["ratio"]], [mean], yerr=_errors([mean], [low], [high]), fmt=marker[row["config"]],
                          color=colour, fillstyle="none", capsize=3)  # fmt: skip
    axis.set_xlabel("bits per element, measured (16 / ratio vs fp16)")
    axis.set_ylabel("task score, points (RULER string match)")
    axis.set_title(f"Finding the fact against pool size: {model}")
    axis.grid(True, alpha=0.3)
    contexts = axis.legend(fontsize=8, title="context", loc="upper left", bbox_to_anchor=(1.02, 1))
    axis.add_artist(contexts)
    handles = [Line2D([], [], marker=marker[c], color="grey", linestyle="none", fillstyle="none", label=c)
               for c in configs]  # fmt: skip
    axis.legend(handles=handles, fontsize=8, title="config", loc="lower left", bbox_to_anchor=(1.02, 0))
    figure.tight_layout()
    return figure


def review_stages(rows: Sequence[dict]):
    """The review's time per stage, one stacked bar per (context, method) that ran it."""
    stages = ("prefetch_s", "planner_s", "specialist_s", "critic_s", "summarizer_s")
    labels = ("prefetch", "planner", "specialists", "critic", "summarizer")
    ran = [r for r in rows if r.get("review_wall_s")]
    figure, axis = plt.subplots(figsize=(8, 0.55 * len(ran) + 1.5))
    names = [f"{r['context_tokens']}: {r['method']}" for r in ran]
    left = [0.0] * len(ran)
    for index, (stage, label) in enumerate(zip(stages, labels, strict=True)):
        widths = [r.get(stage) or 0.0 for r in ran]
        axis.barh(names, widths, left=left, color=f"C{index}", label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axis.invert_yaxis()
    axis.set_xlabel("seconds (the 15-role review, same prompts and tokens)")
    axis.set_title("Time per stage: polykv_agents vs llama.cpp")
    axis.grid(True, axis="x", alpha=0.3)
    axis.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.2 / max(len(ran), 1)))
    return figure
