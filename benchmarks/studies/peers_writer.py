"""``peers.md`` and its plot, from the peers suite's :class:`~polykv_agents.bench.output.SuiteResult`: the
engines' table, who wins each measure (:func:`winners_lines`, also in the README's block), the compression peer's
table and the review's time per stage.

Rows are named as the run recorded them, with two exceptions made in rendering, never in the JSON: a compression
row of a preset whose config has changed since is named by its config (:func:`compression_method`), and
llama-server's many-agent decode figure says how many document prefills it includes (:func:`decode_15_text`).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from polykv_agents.bench.configs import CONFIGS
from polykv_agents.bench.output import MIB, Column, SuiteResult, column, markdown_table, mib_column, write_suite
from polykv_agents.bench.sweep import pct_interval
from polykv_agents.config import PRESETS, CompressionConfig

GGUF_TENSOR_TYPES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": (
        "Q4_1 for its 210 attention and MLP matrices, Q8_0 for the token embedding (which is also the output "
        "head) and F32 for its 61 norms"
    ),
}
"""Model file -> what its tensors store, read with the ``gguf`` package (``GGUFReader(path).tensors``, each
tensor's ``tensor_type``; file type 3, mostly Q4_1) (a documented registry: one entry per file a run used)."""


def formats_note(model_file: str, dtype: str, f16: bool = False) -> str:
    """Which weights each side computes with: both read ``model_file``'s weights, not always in the same format."""
    stored = GGUF_TENSOR_TYPES.get(model_file, "the types it stores")
    f16_text = (
        " The llama.cpp (F16) rows read an F16 file of the same values (`llama-quantize --allow-requantize "
        f"{model_file} OUT.gguf F16`, from the same llama.cpp sources): the weights ours computes with, up to "
        "rounding."
        if f16
        else " llama.cpp rows in F16 need a run with `--gguf-f16`."
    )
    return (
        f"Same weights, not always the same format: both sides read `{model_file}`. llama.cpp (Q4_1) computes with "
        f"its weights as stored ({stored}). Ours de-quantises them once (transformers' GGUF loader) and computes in "
        f"{dtype} (native weights), or re-quantises those values to int8, one scale per output channel, or int4 in "
        "groups of 32 with the output head in int8; each of our rows names its weights, and the rows without a "
        'weights setting ran the defaults of their commit (`weights="auto"`, int8 on a CPU with AMX, since '
        "the run after 0d15bbf; native weights before)." + f16_text
    )


def compression_method(method: str) -> str:
    """A compression row's name as today's configs name it: ``"polykv_agents, max preset (K:tq4 V:tq3)"``, from
    a run before ``max`` was re-decided, becomes ``"polykv_agents, keys tq4, values tq3 (K:tq4 V:tq3; the `max`
    preset when measured)"``, by the config label the row recorded; any other name is returned as it is."""
    match = re.fullmatch(r"polykv_agents, (\w+) preset \((.+)\)", method)
    if match is None or match[1] not in PRESETS or CompressionConfig.preset(match[1]).label() == match[2]:
        return method
    preset, label = match[1], match[2]
    name = next((name for name, config in CONFIGS.items() if config.label() == label), label)
    return f"polykv_agents, {name} ({label}; the `{preset}` preset when measured)"


def document_prefills(row: dict, agents: int) -> int:
    """How many document prefills llama-server's ``agents``-agent decode figure includes: none where every slot
    was given the document first (``slots_warmed``); in runs before that, one slot held the document before the
    timed completions and every other slot that took one of them prefilled it again; 0 for any other method."""
    match = re.match(r"llama-server.*?, (\d+) slot", row["method"])
    if match is None or row.get("decode_tok_s_15") is None or row.get("slots_warmed"):
        return 0
    return min(int(match[1]), agents) - 1


def decode_15_text(row: dict, agents: int) -> str:
    """The many-agent decode figure, with the document prefills it includes, if any."""
    if row.get("decode_tok_s_15") is None:
        return "—"
    prefills = document_prefills(row, agents)
    return f"{row['decode_tok_s_15']:.1f}" + (f" (incl. {prefills} document prefills)" if prefills else "")


def llama_server_decode_note(agents: int, rows: Sequence[dict] = ()) -> str:
    """What llama-server's many-agent decode figure times, per slot setting."""
    if rows and all(r.get("slots_warmed") for r in rows):
        evaluated = "; ".join(
            f"{r['method'].split(', ')[1]} at {r['context_tokens']:,} tokens: "
            f"{statistics.median(r['aggregate_prompt_tokens_evaluated']):,.0f}"
            for r in rows
        )
        return (
            f"llama-server's {agents}-agent decode figure: every slot is given the document first ({agents} "
            f"one-token requests of it at once), then the {agents} completions are timed at once, each evaluating "
            f"only its own question, as ours admits only the questions; with 1 slot they queue over the one context. "
            f"Prompt tokens the server evaluated for the {agents} timed completions (median over documents): "
            f"{evaluated}."
        )
    return (
        f"llama-server's {agents}-agent decode figure puts the document into one slot, then times the {agents} "
        f"completions at once: with {agents} slots it includes {agents - 1} prefills of the document (its slots "
        "do not share the prefix), so it is not a decode speed; with 1 slot the completions queue over the one "
        "context that keeps the document, and each evaluates only its own question."
    )


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


OUR_FIXED_METHOD = "polykv_agents (one pool)"
"""The row of ours that the winners table compares, fixed before measuring: the defaults a user gets (``auto``
weights, eager decode), for every measure; other settings are in the full table, never picked after the fact."""

TIE_FRACTION = 0.05
"""A figure measured once per process (peak RSS, KV bytes) is a tie when the two are within 5% of each other."""

WINNER_MEASURES = (
    ("review wall", "review_wall_s", True),
    ("TTFT from scratch", "ttft_scratch_s", True),
    ("TTFT cold", "ttft_cold_s", True),
    ("TTFT warm", "ttft_warm_s", True),
    ("single-stream decode tok/s", "decode_tok_s", False),
    ("15-agent decode tok/s", "decode_tok_s_15", False),
    ("prefill tok/s", "prefill_tok_s", False),
    ("peak RSS", "rss_peak_bytes", True),
    ("KV bytes resident for the document", "kv_bytes_resident", True),
)
"""(label, key, lower is better) of each measure the winners table compares."""


def _advantage(ours: dict, peer: dict, key: str, lower_is_better: bool) -> tuple[float, float, float, int]:
    """How many times better ours is than ``peer`` on ``key`` (below 1: the peer is better): the mean of the
    per-document ratios with its 95% t-interval where both measured the same documents, else the one ratio
    with the interval of the tie band. ``(mean, low, high, documents)``."""
    from polykv_agents.bench.stats import mean_interval

    def ratio(mine: float, theirs: float) -> float:
        return theirs / mine if lower_is_better else mine / theirs

    mine, theirs = ours.get("samples", {}).get(key), peer.get("samples", {}).get(key)
    if mine and theirs and len(mine) == len(theirs) > 1:
        interval = mean_interval([ratio(a, b) for a, b in zip(mine, theirs, strict=True)])
        return interval.mean, interval.low, interval.high, interval.n
    single = ratio(ours[key], peer[key])
    return single, single * (1 - TIE_FRACTION), single * (1 + TIE_FRACTION), 1


def winner_text(peer_method: str, advantage: tuple[float, float, float, int]) -> str:
    """``"polykv_agents, 1.62x [1.41, 1.83]"``, ``"**llama.cpp**, 2.10x [...]"`` or ``"tie (1.02x [0.95, 1.09])"``:
    a tie where the interval holds 1."""
    mean, low, high, documents = advantage
    band = f" [{low:.2f}, {high:.2f}]" if documents > 1 else ""
    if low <= 1.0 <= high:
        return f"tie ({mean:.2f}x{band})"
    if mean > 1.0:
        return f"polykv_agents, {mean:.2f}x{band}"
    inverse = f" [{1 / high:.2f}, {1 / low:.2f}]" if documents > 1 else ""
    return f"**{peer_method}**, {1 / mean:.2f}x{inverse}"


def winners_lines(rows: list[dict]) -> list[str]:
    """Per context and measure: our fixed row's figure (:data:`OUR_FIXED_METHOD`), the best peer's (by median),
    and who wins, by how much, with the 95% interval over the documents; a tie is called a tie."""
    lines = ["| context | measure | polykv_agents (defaults) | best peer | winner |", "|---:|---|---:|---|---|"]
    for context in sorted({r["context_tokens"] for r in rows}):
        ours = next((r for r in rows if r["context_tokens"] == context and r["method"] == OUR_FIXED_METHOD), None)
        peers = [r for r in rows if r["context_tokens"] == context and not r["method"].startswith("polykv")]
        if ours is None:
            continue
        for label, key, lower_is_better in WINNER_MEASURES:
            measured = [p for p in peers if p.get(key) is not None]
            if ours.get(key) is None or not measured:
                continue
            pick = min if lower_is_better else max
            peer = pick(measured, key=lambda p, key=key: p[key])
            verdict = winner_text(peer["method"], _advantage(ours, peer, key, lower_is_better))
            lines.append(
                f"| {context} | {label} | {measure_text(key, ours[key])} | {measure_text(key, peer[key])} "
                f"({peer['method']}) | {verdict} |"
            )
    return lines


def compression_table(rows: list[dict]) -> str:
    """Bytes and PPL delta of each compressed KV cache, per context (a changed preset named by its config)."""
    return markdown_table(
        rows,
        [
            column("context", "context_tokens"),
            Column("KV cache", lambda r: compression_method(r["method"])),
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


def rss_note(settings: dict) -> str:
    """How the run took each method's peak RSS."""
    if "documents" in settings:  # runs since every method has a process of its own
        return (
            "Peak RSS: every method in a fresh process of its own, one per method and context (`VmHWM`, the model's "
            "load included; llama-server's is its server process's)."
        )
    return (
        "Peak RSS: llama.cpp in a fresh process of its own; ours sampled around our own runs (the model's weights "
        "included; a run with several weights settings holds a copy of the model for each, and every one of them "
        "counts in every row of ours)."
    )


def winners_caption(settings: dict) -> str:
    """What the winners table compares, and over how many documents."""
    if "documents" not in settings:
        return "(runs before the fixed setting and the document intervals: single samples)"
    return (
        f"(ours: `{settings['our_fixed_method']}`, the defaults, fixed before measuring; each peer's best row by "
        f"median; the advantage is the mean of per-document ratios over {settings['documents']} documents with its "
        f"95% t-interval, a tie where it holds 1; peak RSS and KV bytes are one figure per process, a tie within "
        f"{TIE_FRACTION:.0%})"
    )


def write_peers(result: SuiteResult, out_dir: Path) -> list[Path]:
    agents = result.settings.get("roles", 15)
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
        Column("decode tok/s, 1 / 15 agents", lambda r: f"{_rate('decode_tok_s')(r)} / {decode_15_text(r, agents)}"),
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
        "prefilled); cold: the document processed before but not resident (ours: a built pool and a fresh engine; "
        "llama.cpp: its saved state of the document loaded into an empty context); warm: the document resident, "
        "only the prompt is new. llama.cpp's KV is the size of its saved state with the document in it (an f16 "
        "cache, or keys q8_0 and values q4_0 in the rows that name that cache); ours is the pool, and, while "
        "decoding, the pool and what the default runtime holds beside it (a few KiB where it reads the pool as "
        "stored, as the default does on a CPU with AMX tiles; a decoded prefix where it does not, as with compiled "
        "steps). " + rss_note(result.settings),
        *([formats_note(result.settings["model_file"], result.info.dtype, result.settings.get("gguf_f16", False))]
          if "model_file" in result.settings else []),
        "Where each side stands " + winners_caption(result.settings) + ":\n\n" + "\n".join(winners_lines(engines)),
    ]  # fmt: skip
    if server:
        notes.append(
            llama_server_decode_note(agents, [r for r in engines if r["method"].startswith("llama-server")])
            + " Its prompt cache in the review: "
            + "; ".join(
                f"{r['method'].split(', ')[1]} at {r['context_tokens']} tokens evaluated "
                f"{r['prompt_tokens_evaluated']:,} of {r['prompt_tokens']:,} prompt tokens"
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
