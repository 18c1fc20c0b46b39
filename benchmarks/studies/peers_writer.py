"""``peers.md`` and its plot, from the peers suite's :class:`~polykv_agents.bench.output.SuiteResult`: the
engines' table, who wins each measure (:func:`winners_lines`, also in the README's block), the compression peer's
table and the review's time per stage."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from polykv_agents.bench.output import MIB, Column, SuiteResult, column, markdown_table, mib_column, write_suite
from polykv_agents.bench.sweep import pct_interval


def measure_text(key: str, value: float) -> str:
    """A figure of the peer suites in its unit, the unit read from its key (``*_s``, ``*nbytes``, ``*tok_s``...)."""
    if key.endswith("nbytes") or key.startswith(("kv_bytes", "rss")):
        return f"{value / MIB:,.1f} MiB"
    if "tok_s" in key:
        return f"{value:.1f}"
    if key.endswith("_s"):
        return f"{value:.3f} s"
    if key == "ppl_delta_pct":
        return f"{value:+.2f}%"
    return f"{value:.3f}"


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
                measure_text(key, ours[key]) + (f" ({setting})" if setting else ""),
                measure_text(key, peer[key]),
            )
            we_win = best(ours[key], peer[key]) == ours[key]
            ratio = max(ours[key], peer[key]) / min(ours[key], peer[key])
            winner = f"polykv_agents, {ratio:.1f}x" if we_win else f"**{peer['method']}**, {ratio:.1f}x"
            lines.append(f"| {context} | {label} | {show[0]} | {show[1]} ({peer['method']}) | {winner} |")
    return lines


def compression_table(rows: list[dict]) -> str:
    """Bytes and PPL delta of each compressed KV cache, per context."""
    return markdown_table(
        rows,
        [
            column("context", "context_tokens"),
            column("KV cache", "method"),
            mib_column("MiB", "kv_bytes", 2),
            column("x vs fp16", "ratio_vs_fp16", "{:.2f}"),
            Column("PPL delta, mean [95% CI]", pct_interval),
        ],
    )


def review_stages(rows: Sequence[dict]):
    """The review's time per stage, one stacked bar per (context, method) that ran it."""
    from polykv_agents.bench.plots import plt

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
        "graph's order, the calls the pooled graph's last run made (`benchmarks/studies/recording.py`), each "
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
    figures = {"stages": review_stages(engines)}
    return write_suite(
        result, out_dir, title="What else you could run, measured", columns=columns, figures=figures, notes=notes,
        table_rows=engines,
    )  # fmt: skip
