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
    kinds = ("build", "ttft", "throughput", "kernel")
    rows = {kind: [r for r in result.rows if r["kind"] == kind] for kind in kinds}
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
            column("prompt tokens", "prompt_tokens"),
            column("TTFT pool, cold s", "ttft_s_pool_cold", "{:.3f}"),
            column("TTFT pool, warm s", "ttft_s_pool_warm", "{:.3f}"),
            column("TTFT re-prefill s", "ttft_s_reprefill", "{:.2f}"),
            Column("speed-up, cold / warm", lambda r: f"{r['speedup_cold']:.1f}x / {r['speedup_warm']:.1f}x"),
        ],
    )
    throughput = markdown_table(
        rows["throughput"],
        [
            column("agents", "agents"),
            column("tokens/s", "tokens_per_s", "{:.1f}"),
            column("vs one agent", "speedup_vs_one_agent", "{:.2f}x"),
            column("ms per step", "ms_per_step", "{:.0f}"),
        ],
    )
    kernel = markdown_table(
        rows["kernel"],
        [
            column("shape", "shape"),
            column("prefix tokens", "context_tokens"),
            column("agents", "agents"),
            column("query tokens per agent", "query_tokens_per_agent"),
            column("fused kernel ms per layer", "ms_per_layer_fused", "{:.2f}"),
            column("matmul-softmax-matmul ms per layer", "ms_per_layer_unfused", "{:.2f}"),
            column("speed-up", "speedup", "{:.1f}x"),
        ],
    )
    notes = [
        "Targets: compress <= 10% and decompress <= 5% of the prefill time.",
        "Time to first token of one agent (`polykv_agents/bench/ttft.py`). Cold: the first call of a fresh engine, "
        "so the decode of the shared prefix from the pool is inside the timed call. Warm: the prefix is already "
        "resident, as for every later call of a running workflow. Re-prefill: the document and the same prompt "
        "prefilled again into a fresh cache, as a plain local chat model does on every call:\n\n" + ttft,
        "Aggregate decode throughput, N agents at once through the runtime, prefix resident (their prompts' "
        "admission included); ms per step is the median time between an agent's consecutive tokens while all "
        "decode (one batched step each, on the compute thread):\n\n" + throughput,
        "The prefix part of cascade attention for one layer (`polykv_agents/bench/step_costs.py`): PyTorch's fused "
        "CPU attention kernel, which the runtime calls, against the matmul-softmax-matmul fallback kept for other "
        "devices:\n\n" + kernel,
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
    figures = {"ppl_vs_context": plots.ppl_delta_vs_context(ppl, result.info.model)}
    return write_suite(result, out_dir, title="Quality", columns=columns, figures=figures, notes=notes, table_rows=ppl)


def _inversion_verdict(cells: list[dict]) -> str:
    """Whether "the compressed cache scores better than full precision" survives seeds and documents."""
    if not cells:
        return ""
    counts = ", ".join(
        f"{c['negative_documents']}/{c['documents']} documents ({c['negative_samples']}/{c['samples']} samples) "
        f"at {c['context_tokens']}"
        for c in cells
    )
    survives = all(c["ci_excludes_zero_below"] for c in cells)
    verdict = "it survives" if survives else "it does not survive: no interval of the default config lies below zero"
    return f"PPL inversion: the default config scored better than full precision in {counts}; {verdict}."


def write_ablation(result: SuiteResult, out_dir: Path) -> list[Path]:
    columns = [
        column("config", "config"),
        column("factor", "factor"),
        column("context", "context_tokens"),
        column("x vs fp16", "compression_ratio_vs_fp16", "{:.2f}"),
        Column("PPL delta, mean [95% CI]", _pct_interval),
        Column("range", _pct_range),
        Column("documents below zero", lambda r: f"{r['negative_documents']}/{r['documents']}"),
        Column("samples below zero", lambda r: f"{r['negative_samples']}/{r['sample_count']}"),
        column("seeds", "seeds"),
    ]
    summary = result.summary
    notes = [
        "Each row keeps every (document, seed) sample in ablation.json. The interval and the range are over "
        "documents, each the mean of its seeds (deterministic configs: one seed), because the seeds of one "
        f"document share its text and its reference. The smallest of these "
        f"pools whose mean delta is <= +{summary['max_preset_budget_pct']:.0f}% at every context: "
        f"**{summary['max_preset']}** ({summary['max_preset_ratio_vs_fp16']:.2f}x vs fp16)."
        if summary.get("max_preset")
        else "No config stayed within the +1% budget.",
        _inversion_verdict(summary.get("ppl_inversion_default", [])),
    ]
    figures = {f"{context}": plots.ablation_deltas(result.rows, context) for context in result.settings["contexts"]}
    return write_suite(result, out_dir, title="Ablation", columns=columns, figures=figures, notes=notes)


def write_frontier(result: SuiteResult, out_dir: Path) -> list[Path]:
    summary = result.summary
    front = set(summary["pareto_front"])
    columns = [
        column("config", "config"),
        column("codecs", "config_label"),
        column("context", "context_tokens"),
        column("x vs fp16", "compression_ratio_vs_fp16", "{:.2f}"),
        Column("bits per element", lambda r: f"{16 / r['compression_ratio_vs_fp16']:.2f}"),
        Column("PPL delta, mean [95% CI]", _pct_interval),
        Column("range", _pct_range),
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
    figures = {"ppl_vs_bytes": plots.frontier(result.rows, summary["pareto_front"], budget, target, result.info.model)}
    return write_suite(result, out_dir, title="Compression frontier", columns=columns, figures=figures, notes=notes)


def _value(key: str, value: float) -> str:
    if key.endswith("nbytes") or key.startswith(("kv_bytes", "rss")):
        return f"{value / MIB:,.1f} MiB"
    if "tok_s" in key:
        return f"{value:.1f}"
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


def _seconds(key: str, digits: int = 1):
    return lambda r: "—" if r.get(key) is None else f"{r[key]:.{digits}f} s"


def _rate(key: str):
    return lambda r: "—" if r.get(key) is None else f"{r[key]:.1f}"


def _mib(key: str):
    return lambda r: "—" if r.get(key) is None else f"{r[key] / MIB:,.0f}"


def _our_setting(row: dict) -> str:
    """What is not the default in one of our rows: ``"int8 weights"``, ``"int8 weights, compiled decode"``, ``""``."""
    parts = [] if row.get("weights", "native") == "native" else [f"{row['weights']} weights"]
    return ", ".join(parts + (["compiled decode"] if row.get("compiled_decode") else []))


def winners_lines(rows: list[dict]) -> list[str]:
    """Per context and measure: our best figure (with the settings that gave it, when not the defaults), the best
    peer's, and who wins (the table says so where a peer does)."""
    measures = (
        ("review wall", "review_wall_s", min),
        ("TTFT from scratch", "ttft_scratch_s", min),
        ("TTFT cold", "ttft_cold_s", min),
        ("TTFT warm", "ttft_warm_s", min),
        ("single-stream decode tok/s", "decode_tok_s", max),
        ("15-agent decode tok/s", "decode_tok_s_15", max),
        ("prefill tok/s", "prefill_tok_s", max),
        ("peak RSS", "rss_peak_bytes", min),
        ("KV bytes resident for the document", "kv_bytes_resident", min),
    )
    lines = ["| context | measure | polykv_agents | best peer | winner |", "|---:|---|---:|---|---|"]
    for context in sorted({r["context_tokens"] for r in rows}):
        mine = [r for r in rows if r["context_tokens"] == context and r["method"].startswith("polykv")]
        peers = [r for r in rows if r["context_tokens"] == context and not r["method"].startswith("polykv")]
        for label, key, best in measures:
            measured = [p for p in peers if p.get(key) is not None]
            candidates = [r for r in mine if r.get(key) is not None]
            if not candidates or not measured:
                continue
            ours = best(candidates, key=lambda r, key=key: r[key])
            peer = best(measured, key=lambda p, key=key: p[key])
            setting = _our_setting(ours)
            show = (
                _value(key, ours[key]) + (f" ({setting})" if setting else ""),
                _value(key, peer[key]),
            )
            we_win = best(ours[key], peer[key]) == ours[key]
            ratio = max(ours[key], peer[key]) / min(ours[key], peer[key])
            winner = f"polykv_agents, {ratio:.1f}x" if we_win else f"**{peer['method']}**, {ratio:.1f}x"
            lines.append(f"| {context} | {label} | {show[0]} | {show[1]} ({peer['method']}) | {winner} |")
    return lines


def write_peers(result: SuiteResult, out_dir: Path) -> list[Path]:
    columns = [
        column("context", "context_tokens"),
        column("method", "method"),
        Column("review wall", _seconds("review_wall_s")),
        Column("prefetch", _seconds("prefetch_s")),
        Column("planner", _seconds("planner_s")),
        Column("specialists", _seconds("specialist_s")),
        Column("critic", _seconds("critic_s")),
        Column("summarizer", _seconds("summarizer_s")),
        Column("TTFT scratch", _seconds("ttft_scratch_s", 2)),
        Column("TTFT cold", _seconds("ttft_cold_s", 3)),
        Column("TTFT warm", _seconds("ttft_warm_s", 3)),
        Column("decode tok/s, 1 / 15 agents", lambda r: f"{_rate('decode_tok_s')(r)} / {_rate('decode_tok_s_15')(r)}"),
        Column("prefill tok/s", _rate("prefill_tok_s")),
        Column("peak RSS MiB", _mib("rss_peak_bytes")),
        Column("KV MiB, stored / resident", lambda r: f"{_mib('kv_bytes')(r)} / {_mib('kv_bytes_resident')(r)}"),
    ]
    engines = [r for r in result.rows if r.get("kind", "engine") == "engine"]
    compression = [r for r in result.rows if r.get("kind") == "compression"]
    server = [r for r in engines if r.get("prompt_tokens_evaluated") is not None]
    notes = [
        "Every method decodes the same tokens from the same prompts: llama.cpp replays, token for token and in the "
        "graph's order, the calls the pooled graph's last run made (`polykv_agents/bench/recording.py`), each "
        "decoding exactly as many tokens, greedily. Stages of llama.cpp are the sums of its calls; its document "
        "prefill falls in the planner's call. TTFT from scratch: nothing processed before (document and prompt "
        "prefilled); cold: the document processed before but not resident (ours: a built pool and a fresh engine, "
        "which decodes the prefix; llama.cpp: its saved state of the document loaded into an empty context); "
        "warm: the document resident, only the prompt is new. llama.cpp's KV is the size of its saved state "
        "with the document in it (f16 KV); ours is the pool, and, while decoding, the pool plus its decoded "
        "prefix. Peak RSS: llama.cpp in a fresh process of its own; ours sampled around our own runs (the "
        "model's weights included; a run with several weights settings holds a copy of the model for each, and "
        "every one of them counts in every row of ours).",
        "Where each side stands:\n\n" + "\n".join(winners_lines(engines)),
    ]
    if server:
        notes.append(
            "llama-server's prompt cache: "
            + "; ".join(
                f"at {r['context_tokens']} tokens it evaluated {r['prompt_tokens_evaluated']:,} of "
                f"{r['prompt_tokens']:,} prompt tokens"
                for r in server
            )
            + "."
        )
    if compression:
        notes.append(
            "The compression peer: transformers' own `QuantizedCache` (quanto backend, groups of 64 along the head "
            "dimension, scales in the model's dtype) against this project's presets, by the quality suite's "
            f"protocol ({result.settings['continuation_tokens']} continuation tokens after the context, mean and 95% "
            f"interval over {result.settings['compression_documents']} pydoc_data.topics texts):\n\n"
            + compression_table(compression)
        )
    figures = {"stages": plots.review_stages(engines)}
    return write_suite(
        result, out_dir, title="What else you could run, measured", columns=columns, figures=figures, notes=notes,
        table_rows=engines,
    )  # fmt: skip


def compression_table(rows: list[dict]) -> str:
    """Bytes and PPL delta of each compressed KV cache, per context."""
    return markdown_table(
        rows,
        [
            column("context", "context_tokens"),
            column("KV cache", "method"),
            mib_column("MiB", "kv_bytes", 2),
            column("x vs fp16", "ratio_vs_fp16", "{:.2f}"),
            Column("PPL delta, mean [95% CI]", _pct_interval),
        ],
    )


def write_dtype(result: SuiteResult, out_dir: Path) -> list[Path]:
    """Speed per dtype makes the main table; perplexity and the OpenMP teams get tables in the notes."""
    speed = [r for r in result.rows if r["kind"] == "speed"]
    teams = [r for r in result.rows if r["kind"] == "teams"]
    n = speed[0]["agents"]
    columns = [
        column("dtype", "dtype"),
        column("context", "context_tokens"),
        column("prefill s", "prefill_s", "{:.2f}"),
        column("ms per step, 1 agent", "ms_per_step_1", "{:.1f}"),
        column(f"ms per step, {n} agents", "ms_per_step_n", "{:.1f}"),
        column(f"tokens/s, {n} agents", "tok_s_n", "{:.1f}"),
    ]
    ppl = markdown_table(
        result.summary["ppl"],
        [
            column("model reads in", "reader"),
            column("cache", "cache"),
            Column("PPL delta vs fp32 full cache, mean [95% CI]", _pct_interval),
            column("documents", "documents"),
        ],
    )
    team_table = markdown_table(
        teams,
        [
            column("dtype", "dtype"),
            column("rows", "batch_size"),
            column("one team ms", "ms_one_team", "{:.1f}"),
            column("after a second thread's tensor work ms", "ms_after_second_team", "{:.1f}"),
            Column("slower by", lambda r: f"{r['ms_after_second_team'] / r['ms_one_team']:.2f}x"),
        ],
    )
    settings = result.settings
    notes = [
        f"Both dtypes in one run, {settings['repetitions']} repetitions after a warm-up (medians). ms per step: the "
        "median time between an agent's consecutive tokens while all decode through the runtime, over a pool built "
        "by a model of that dtype.",
        f"Perplexity of the {settings['continuation_tokens']} tokens after a {settings['context']}-token prefix, "
        f"{settings['documents']} pydoc texts, intervals over documents. A pool holds codes and one pool (one digest) "
        "serves both dtypes; a model that reads a pool built by the other dtype reads keys and values that its own "
        "forward would have computed slightly differently:\n\n" + ppl,
        "One forward over one token per row (no cache) on the compute thread, before and after a second thread of "
        "the process ran one such forward and stayed alive, idle, each in a fresh process "
        "(`polykv_agents/bench/openmp_teams.py`; why: `polykv_agents/model/compute_thread.py`):\n\n" + team_table,
    ]
    return write_suite(result, out_dir, title="fp32 and bf16", columns=columns, notes=notes, table_rows=speed)


def write_weights(result: SuiteResult, out_dir: Path) -> list[Path]:
    """Speed and size per weights setting make the main table; kernels and perplexity get tables in the notes."""
    speed = [r for r in result.rows if r["kind"] == "speed"]
    n = speed[0]["agents"]
    columns = [
        column("weights", "weights"),
        column("dtype", "dtype"),
        column("MiB of weights", "model_mib", "{:.0f}"),
        column("prefill s", "prefill_s", "{:.2f}"),
        column("ms per step, 1 agent", "ms_per_step_1", "{:.1f}"),
        column(f"ms per step, {n} agents", "ms_per_step_n", "{:.1f}"),
        column(f"tokens/s, {n} agents", "tok_s_n", "{:.1f}"),
    ]
    kernels = markdown_table(
        [r for r in result.rows if r["kind"] == "kernel"],
        [
            column("weights", "weights"),
            column("layer", "layer"),
            column("weight shape", "shape"),
            column("rows", "rows"),
            column("µs per call", "us_per_call", "{:.0f}"),
        ],
    )
    ppl = markdown_table(
        result.summary["ppl"],
        [
            column("weights", "weights"),
            column("cache", "cache"),
            Column("PPL delta vs native full cache, mean [95% CI]", _pct_interval),
            column("documents", "documents"),
        ],
    )
    settings = result.settings
    notes = [
        f"All three in one run, {settings['repetitions']} repetitions after a warm-up (medians). ms per step: the "
        "median time between an agent's consecutive tokens while all decode through the runtime, over a pool built "
        "by that model. MiB of weights: `nbytes` of the model's parameters and buffers (a tied tensor once).",
        "One projection per call, the weights read from memory (every layer's `mlp.up_proj` in turn), and the "
        "output layer; the quantized layers' kernels are PyTorch's (`polykv_agents/model/quantized_linear.py`):\n\n"
        + kernels,
        f"Perplexity of the {settings['continuation_tokens']} tokens after a {settings['context']}-token prefix, "
        f"{settings['documents']} pydoc texts, intervals over documents. One pool digest serves every setting:\n\n"
        + ppl,
    ]
    return write_suite(result, out_dir, title="Weight-only int8 and int4", columns=columns, notes=notes,
                       table_rows=speed)  # fmt: skip


WRITERS = {
    "dtype": write_dtype,
    "weights": write_weights,
    "memory": write_memory,
    "quality": write_quality,
    "speed": write_speed,
    "ablation": write_ablation,
    "frontier": write_frontier,
    "peer": write_peer,
    "peers": write_peers,
}
"""Suite name -> the function that writes its Markdown and plots from its :class:`SuiteResult`."""
