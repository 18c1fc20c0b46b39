"""Each suite's Markdown table, notes and plots, written next to its JSON by :func:`write_suite`."""

from __future__ import annotations

from pathlib import Path

from polykv_agents.bench import plots
from polykv_agents.bench.output import MIB, Column, SuiteResult, column, markdown_table, mib_column, write_suite


def _pct_interval(row: dict) -> str:
    return f"{row['delta_pct_mean']:+.2f}% [{row['delta_pct_ci_low']:+.2f}, {row['delta_pct_ci_high']:+.2f}]"


def _pct_range(row: dict) -> str:
    return f"{row['delta_pct_min']:+.2f} .. {row['delta_pct_max']:+.2f}"


def _rss_pair(row: dict) -> str:
    return f"{row['rss_peak_ours'] / 2**30:.2f} / {row['rss_peak_separate'] / 2**30:.2f}"


def write_memory(result: SuiteResult, out_dir: Path) -> list[Path]:
    columns = [
        column("context", "context_tokens"),
        column("agents", "agents"),
        mib_column("pool MiB", "pool_nbytes", 2),
        mib_column("one fp16 cache MiB", "fp16_nbytes"),
        mib_column("peak KV, ours MiB", "kv_bytes_ours_peak"),
        mib_column("N separate caches MiB", "kv_bytes_separate_model_dtype"),
        mib_column("N separate fp16 caches MiB", "kv_bytes_separate_fp16"),
        column("saving", "saving_vs_separate_model_dtype", "{:.1f}x"),
        Column("peak RSS GiB, ours / separate", _rss_pair),
    ]
    notes = [
        "Peak KV, ours: pool + decoded shared prefix + the batch's suffix cache while N agents decode at once. "
        "Separate caches: N decoded copies of the pool alive at once, as the reference design makes one per agent "
        "call (model dtype, and fp16 for comparison with the paper). All bytes are `nbytes` of tensors that "
        "existed; RSS is the whole process, sampled every 5 ms."
    ]
    figures = {"vs_agents": plots.memory_vs_agents(result.rows)}
    return write_suite(result, out_dir, title="Memory", columns=columns, figures=figures, notes=notes)


def write_speed(result: SuiteResult, out_dir: Path) -> list[Path]:
    """The build rows make the main table; TTFT and throughput get small tables in the notes."""
    rows = {kind: [r for r in result.rows if r["kind"] == kind] for kind in ("build", "ttft", "throughput")}
    columns = [
        column("context", "context_tokens"),
        column("prefill s", "prefill_s", "{:.2f}"),
        column("compress s", "compress_s", "{:.3f}"),
        column("compress % of prefill", "compress_pct_of_prefill", "{:.1f}%"),
        column("decompress s", "decompress_s", "{:.3f}"),
        column("decompress % of prefill", "decompress_pct_of_prefill", "{:.1f}%"),
        mib_column("pool MiB", "pool_nbytes", 2),
    ]
    ttft = markdown_table(
        rows["ttft"],
        [
            column("context", "context_tokens"),
            column("TTFT pool s", "ttft_s_pool", "{:.3f}"),
            column("TTFT re-prefill s", "ttft_s_reprefill", "{:.2f}"),
            column("speedup", "ttft_speedup", "{:.1f}x"),
        ],
    )
    throughput = markdown_table(
        rows["throughput"],
        [
            column("agents", "agents"),
            column("tokens/s", "tokens_per_s", "{:.1f}"),
            column("vs one agent", "speedup_vs_one_agent", "{:.2f}x"),
        ],
    )
    notes = [
        "Targets: compress <= 10% and decompress <= 5% of the prefill time.",
        "Time to first token, one agent from the pool against re-prefilling document + question:\n\n" + ttft,
        "Aggregate decode throughput, N agents at once through the runtime (their prompts' admission included):\n\n"
        + throughput,
    ]
    figures = {"throughput": plots.throughput_vs_agents(rows["throughput"])}
    return write_suite(
        result, out_dir, title="Speed", columns=columns, figures=figures, notes=notes, table_rows=rows["build"]
    )


def write_quality(result: SuiteResult, out_dir: Path) -> list[Path]:
    ppl = [r for r in result.rows if r["kind"] == "ppl"]
    agreement = [r for r in result.rows if r["kind"] == "agreement"]
    columns = [
        column("config", "config"),
        column("codecs", "config_label"),
        column("context", "context_tokens"),
        column("x vs fp16", "compression_ratio_vs_fp16", "{:.2f}"),
        Column("PPL delta, mean [95% CI]", _pct_interval),
        Column("range", _pct_range),
        column("documents", "documents"),
    ]
    agreement_columns = [
        column("config", "config"),
        column("answers", "answers"),
        column("exact match", "exact_match", "{:.2f}"),
        column("token F1", "token_f1", "{:.3f}"),
    ]
    if all("minilm_cosine" in r for r in agreement):
        agreement_columns.append(column("MiniLM cosine", "minilm_cosine", "{:.3f}"))
    notes = [
        "Agreement of pooled answers with answers over the uncompressed cache (greedy, same prompts, "
        f"{result.settings['agreement_context']}-token prefix). MiniLM cosine is the cosine similarity of "
        "all-MiniLM-L6-v2 sentence embeddings, not BERTScore (which needs a roberta-large download):\n\n"
        + markdown_table(agreement, agreement_columns)
    ]
    figures = {"ppl_vs_context": plots.ppl_delta_vs_context(ppl)}
    return write_suite(result, out_dir, title="Quality", columns=columns, figures=figures, notes=notes, table_rows=ppl)


def _inversion_verdict(cells: list[dict]) -> str:
    """Whether "the compressed cache scores better than full precision" survives seeds and documents."""
    if not cells:
        return ""
    counts = ", ".join(f"{c['negative_samples']}/{c['samples']} at {c['context_tokens']}" for c in cells)
    survives = all(c["ci_excludes_zero_below"] for c in cells)
    verdict = "it survives" if survives else "it does not survive: no interval of the default config lies below zero"
    return f"PPL inversion: the default config scored better than full precision in {counts} samples; {verdict}."


def write_ablation(result: SuiteResult, out_dir: Path) -> list[Path]:
    columns = [
        column("config", "config"),
        column("factor", "factor"),
        column("context", "context_tokens"),
        column("x vs fp16", "compression_ratio_vs_fp16", "{:.2f}"),
        Column("PPL delta, mean [95% CI]", _pct_interval),
        Column("range", _pct_range),
        Column("below zero", lambda r: f"{r['negative_samples']}/{r['samples']}"),
        column("seeds", "seeds"),
    ]
    summary = result.summary
    notes = [
        f"Samples per row: documents x seeds (deterministic configs: one seed). `max` preset rule: the smallest "
        f"pool whose mean delta is <= +{summary['max_preset_budget_pct']:.0f}% at every context: "
        f"**{summary['max_preset']}** ({summary['max_preset_ratio_vs_fp16']:.2f}x vs fp16)."
        if summary.get("max_preset")
        else "No config stayed within the `max` preset's budget.",
        _inversion_verdict(summary.get("ppl_inversion_default", [])),
    ]
    figures = {f"{context}": plots.ablation_deltas(result.rows, context) for context in result.settings["contexts"]}
    return write_suite(result, out_dir, title="Ablation", columns=columns, figures=figures, notes=notes)


def _value(key: str, value: float) -> str:
    if key.endswith("nbytes") or key.startswith(("kv_bytes", "rss")):
        return f"{value / MIB:,.1f} MiB"
    if key.endswith("_s"):
        return f"{value:.3f} s"
    if key == "ppl_delta_pct":
        return f"{value:+.2f}%"
    return f"{value:.3f}"


def write_peer(result: SuiteResult, out_dir: Path) -> list[Path]:
    columns = [
        column("measure", "label"),
        Column("polykv_agents", lambda r: _value(r["metric"], r["ours"])),
        Column(result.settings["peer"], lambda r: _value(r["metric"], r["peer"])),
        column("better", "better"),
    ]
    examples = "\n".join(
        f"- *{e['question']}*\n  - ours: {e['ours'].strip()!r}\n  - polykv-llm: {e['peer'].strip()!r}"
        for e in result.summary["examples"]
    )
    notes = [
        f"polykv-llm reports its own ratio as {result.summary['peer_claimed_ratio']:.2f}x (a formula); the "
        "row above is the ratio measured from its stored tensors. Answer agreement compares each side with its "
        "own full-precision answers to the same questions (polykv-llm sends the raw question, polykv_agents "
        "the chat template). The N-agents rows: polykv-llm decodes the pool into a full-precision cache per "
        "call (N alive at once); polykv_agents runs the N agents through its batched runtime over one shared "
        "prefix. Both processes hold the model's weights as well.",
        "First document's answers:\n\n" + examples,
    ]
    return write_suite(result, out_dir, title="Peer: polykv-llm 0.1.0", columns=columns, notes=notes)


WRITERS = {
    "memory": write_memory,
    "quality": write_quality,
    "speed": write_speed,
    "ablation": write_ablation,
    "peer": write_peer,
}
"""Suite name -> the function that writes its Markdown and plots from its :class:`SuiteResult`."""
