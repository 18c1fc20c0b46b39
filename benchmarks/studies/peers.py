"""``python -m benchmarks peers``: what else a user could run, measured side by side in one run.

Same machine, same weights, same prompts in the same order, greedy, the same number of tokens decoded per
call, over the same documents (``--documents`` independent pydoc texts; every method runs the review and the
probe once on each, figures are medians, intervals come from the documents). Every method runs in a fresh
process of its own (one per method and context), so each peak RSS is one process's ``VmHWM``, its model load
included. Weight formats (:func:`~benchmarks.studies.peers_writer.formats_note`): llama.cpp computes with the
file's Q4_1 matrices as stored and, given ``--gguf-f16``, with an F16 file of the same weights; ours
de-quantises them (int8 where ``weights="auto"`` picks it, bf16 with ``--weights native``, int4 with ``--weights
int4``):

- **polykv_agents** (:mod:`benchmarks.studies.ours_side`): the 15-role document-review graph with one pool
  (graphs/document_review.py), its calls recorded token for token
  (:class:`~benchmarks.studies.recording.RecordingEngine`);
- **llama.cpp** through llama-cpp-python (the engine behind LangChain's ``ChatLlamaCpp``,
  :mod:`benchmarks.studies.llamacpp_side`): the recorded calls replayed one after another over one context,
  so its automatic prefix reuse keeps the document; flash attention off and on, and on with the KV cache
  quantized (keys q8_0, values q4_0: :data:`QUANTIZED_CACHE`); and, at the smallest
  context, on the first document, with a reset before every call (re-prefilling, as without prefix reuse);
- **llama-server** (llama.cpp's own server, built from the same sources, :mod:`benchmarks.studies.llama_server`),
  unified KV cache and prompt cache: with 1 slot, the review (the specialists sent at once queue over the one
  context that keeps the document) and the many-agent decode, the slot holding the document first. 15 slots are
  not run: each slot prefills the document again, which made them 9-13x slower than 1 slot (:data:`SERVER_SLOTS`).

Besides the review's wall and per-stage time: time to first token cold and warm, single-stream and
15-agent decode speed, prefill speed, peak RSS and the KV bytes each holds for the document.

The compression peer is transformers' own ``QuantizedCache`` (quanto backend, 4 and 2 bits,
:mod:`benchmarks.studies.hf_quantized`): its bytes and perplexity delta against this project's presets,
on the same texts, contexts and protocol (``kind="compression"`` rows; the engines' rows are
``kind="engine"``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pydantic import Field, FilePath, field_validator, model_validator

from benchmarks.studies.peers_writer import (
    OUR_FIXED_METHOD,
    compression_table,
    decode_15_text,
    formats_note,
    llama_server_decode_note,
    winners_caption,
    winners_lines,
    write_peers,
)
from benchmarks.studies.side_process import run_side_kept
from benchmarks.studies.workflows import LANGGRAPH_JSON
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, SuiteResult
from polykv_agents.bench.suite import SuiteOptions, TableSuite
from polykv_agents.model.weights import check_weights_choice

LLAMACPP_SIDE = Path(__file__).with_name("llamacpp_side.py")
OURS_SIDE = Path(__file__).with_name("ours_side.py")
AGENTS = 15
SIDE_TIMEOUT_S = 3 * 3600


class PeersOptions(SuiteOptions):
    contexts: list[int] = Field(default=[2048, 4096], json_schema_extra={"flag": "--context"})
    """Document tokens (repeatable)."""
    max_tokens: int = Field(default=32, ge=1)
    """Tokens every free-text answer decodes (EOS ignored), for every method."""
    documents: int = Field(default=5, ge=1)
    """Independent documents (pydoc texts): every method runs the review and the probe once on each."""
    llama_server: FilePath | None = None
    """The llama-server binary (built from the llama-cpp-python sdist's llama.cpp, see docs/RESULTS.md);
    without it the server is not measured."""
    gguf_f16: FilePath | None = None
    """An F16 GGUF of the embedded model's weights, for llama.cpp rows in F16 (made with the same sources'
    quantizer: ``llama-quantize --allow-requantize MODEL.gguf OUT.gguf F16``); without it, no F16 rows."""
    reset_baseline: bool = True
    """Also replay with a reset before every call (re-prefilling), at the smallest context, first document."""
    compression_documents: int = Field(default=3, ge=0)
    """Texts for the compression peer (bytes and PPL of transformers' QuantizedCache vs the presets); 0: skip."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists graphs/document_review.py."""
    keep_in: Path | None = None
    """A folder where each side process's result is kept as it finishes, so that a run stopped part way starts
    again where it stopped (at the same commit, with no uncommitted changes); default: kept nowhere."""
    weights: list[str] = Field(default=["auto"], min_length=1)
    """How our model stores its weights (auto: the default, native, int8, int4), one set of our rows each
    (repeatable); llama.cpp replays the calls of the first. The winners table compares the defaults (auto weights,
    eager), fixed in advance; each row records the weights ``auto`` resolved to."""
    compiled: list[str] = Field(default=[])
    """Weights settings (of ``--weights``) measured once more with the compiled decode step (repeatable), its
    compilation done in the warm-up, as the prefetch node does it once per process; its seconds are reported."""

    @field_validator("weights", "compiled")
    @classmethod
    def _known_weights(cls, value: list[str]) -> list[str]:
        return [check_weights_choice(weights) for weights in value]

    @model_validator(mode="after")
    def _compiled_among_weights(self) -> PeersOptions:
        missing = [w for w in self.compiled if w not in self.weights]
        if missing:
            msg = (
                f"--compiled {missing[0]} needs --weights {missing[0]} too: it adds compiled rows to a weights setting"
            )
            raise ValueError(msg)
        return self

    def variants(self) -> list[tuple[str, bool]]:
        """Our settings, ``(weights, compiled)``, in the order they are measured."""
        return [(w, compiled) for w in self.weights for compiled in (False, True) if not compiled or w in self.compiled]


def our_method(weights: str, compiled: bool = False) -> str:
    """The method name of our rows with ``weights`` (``auto``, the default, names none), and the compiled decode step
    or not."""
    return (
        "polykv_agents (one pool)"
        + ("" if weights == "auto" else f", {weights} weights")
        + (", compiled decode" if compiled else "")
    )


PROBE_FIGURES = (
    "ttft_scratch_s", "ttft_cold_s", "ttft_warm_s", "decode_tok_s", "decode_tok_s_15", "prefill_tok_s", "kv_bytes",
    "kv_bytes_resident",
)  # fmt: skip
STAGES = ("prefetch", "planner", "specialist", "critic", "summarizer")


def review_samples(reviews: list[dict]) -> dict[str, list[float]]:
    """Per-document review figures: wall and each stage's seconds (llama.cpp has no prefetch stage: 0)."""
    samples = {"review_wall_s": [r["wall_s"] for r in reviews]}
    for stage in STAGES:
        samples[f"{stage}_s"] = [r["stage_s"].get(stage, 0.0) for r in reviews]
    return samples


def probe_samples(probes: list[dict]) -> dict[str, list[float]]:
    """Per-document probe figures, each key that the probes measured."""
    keys = [key for key in PROBE_FIGURES if probes and probes[0].get(key) is not None]
    return {key: [p[key] for p in probes] for key in keys}


def engine_row(context: int, method: str, samples: dict[str, list[float]], **extra: Any) -> dict[str, Any]:
    """One method's row: the median of each figure over the documents, and the per-document samples."""
    return {
        "kind": "engine",
        "context_tokens": context,
        "method": method,
        **{key: statistics.median(values) for key, values in samples.items()},
        "samples": samples,
        **extra,
    }


def _review_extra(reviews: list[dict]) -> dict[str, Any]:
    return {"review_calls": reviews[0]["calls"], "review_output_tokens": [r["output_tokens"] for r in reviews]}


def review_peak(stage_peaks: dict[str, int]) -> int:
    """The peak RSS of a process that loads the model and runs the reviews: every stage's but the probe's, whose
    extra full caches (a prefill timed again, TTFT from scratch) no user's review holds."""
    return max(peak for stage, peak in stage_peaks.items() if stage != "probes")


def our_row(request: dict[str, Any], method: str, keep_in: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our row for ``request`` (:mod:`benchmarks.studies.ours_side`'s), run in a fresh process (kept in
    ``keep_in``), and that process's result (its calls and probe ids, for llama.cpp to replay)."""
    side = run_side_kept(OURS_SIDE, request, keep_in=keep_in, what=f"our run ({method})", timeout_s=SIDE_TIMEOUT_S)
    samples = {**review_samples(side["reviews"]), **probe_samples(side["probes"])}
    samples["review_input_tokens"] = [sum(len(c["input_ids"]) for c in replay) for replay in side["replays"]]
    row = engine_row(
        request["context"], method, samples, **_review_extra(side["reviews"]), weights=side["weights"],
        compiled_decode=request["compiled"], warm_up_s=side["warm_up_s"], load_s=side["load_s"],
        rss_peak_bytes=side["rss_peak_bytes"], rss_after_load_bytes=side["rss_after_load_bytes"],
        rss_stage_peak_bytes=side["rss_stage_peak_bytes"],
        rss_peak_review_bytes=review_peak(side["rss_stage_peak_bytes"]),
    )  # fmt: skip
    return row, side


def _ours(options: PeersOptions, context: int, texts: list[str], roles: list[str], progress: Progress):
    """Our rows at ``context``, one fresh process per setting; the first setting's calls and probe ids."""
    rows, first = [], None
    for weights, compiled in options.variants():
        method = our_method(weights, compiled)
        progress(f"context {context}: {method}, {len(texts)} documents")
        request = {
            "weights": weights, "compiled": compiled, "graphs": str(options.graphs), "max_tokens": options.max_tokens,
            "roles": roles, "context": context, "texts": texts,
        }  # fmt: skip
        row, side = our_row(request, method, options.keep_in)
        rows.append(row)
        first = first or side
    return rows, first["replays"], first["probe_ids"]


QUANTIZED_CACHE = ["q8_0", "q4_0"]
"""llama.cpp's smallest KV cache in common use (``--cache-type-k q8_0 --cache-type-v q4_0``): keys 8.5 and values
4.5 bits an element, block-scaled; the peer for the pool's bytes."""


def llama_cpp_method(fmt: str, flash: bool, cache_types: list[str] | None = None) -> str:
    """A llama.cpp row's method name: ``"llama.cpp (Q4_1), prefix reuse, flash attention on, cache q8_0/q4_0"``
    (no cache part for the f16 cache)."""
    cache = f", cache {'/'.join(cache_types)}" if cache_types else ""
    return f"llama.cpp ({fmt}), prefix reuse, flash attention {'on' if flash else 'off'}{cache}"


def _llamacpp_side(options: PeersOptions, request: dict[str, Any], method: str) -> dict[str, Any]:
    """One llama.cpp side process (kept in ``options.keep_in``); its result."""
    what = f"the llama.cpp run ({method})"
    return run_side_kept(LLAMACPP_SIDE, request, keep_in=options.keep_in, what=what, timeout_s=SIDE_TIMEOUT_S)


def replay_context(replays: list[list[dict]], max_tokens: int) -> int:
    """The context llama.cpp needs to replay ``replays`` over one sequence: the longest call, its answer, a margin."""
    return max(len(c["input_ids"]) for replay in replays for c in replay) + max_tokens + 64


def replay_probes(probe_ids: list[dict]) -> list[dict]:
    """What llama.cpp's side reads of our probe's token ids, per document."""
    keys = ("document_ids", "prompt_ids", "other_prompt_ids", "decode_tokens")
    return [{k: ids[k] for k in keys} for ids in probe_ids]


def llama_cpp_row(context: int, method: str, result: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A llama.cpp side process's row: its review and probe figures, the KV it held (the sequence state's bytes),
    its memory."""
    samples = {**review_samples(result["reviews"]), **probe_samples(result["probes"])}
    if result["probes"]:
        samples["kv_bytes"] = samples["kv_bytes_resident"] = [p["state_bytes"] for p in result["probes"]]
    return engine_row(
        context, method, samples, **_review_extra(result["reviews"]), rss_peak_bytes=result["rss_peak_bytes"],
        rss_after_load_bytes=result.get("rss_after_load_bytes"), **extra,
    )  # fmt: skip


def _llama_cpp(options: PeersOptions, context: int, replays: list, probe_ids: list, progress: Progress) -> list:
    """llama.cpp's rows at ``context``: each file format and flash setting in a fresh process."""
    from polykv_agents.model.loading import embedded_model_file

    n_ctx = replay_context(replays, options.max_tokens)
    runs = [("Q4_1", embedded_model_file(), False, None), ("Q4_1", embedded_model_file(), True, None)]
    runs.append(("Q4_1", embedded_model_file(), True, QUANTIZED_CACHE))  # flash attention: quantized values need it
    if options.gguf_f16 is not None:
        runs.append(("F16", options.gguf_f16, True, None))
    rows = []
    for fmt, path, flash, cache_types in runs:
        method = llama_cpp_method(fmt, flash, cache_types)
        progress(f"context {context}: {method}")
        request = {
            "model_path": str(path), "n_ctx": n_ctx, "threads": threads(), "flash_attn": flash,
            "cache_types": cache_types, "reset_every_call": False, "reviews": replays,
            "probes": replay_probes(probe_ids),
        }  # fmt: skip
        result = _llamacpp_side(options, request, method)
        rows.append(llama_cpp_row(context, method, result, gguf_format=fmt, cache_types=cache_types or ["f16", "f16"]))
    if options.reset_baseline and context == min(options.contexts):
        method = "llama.cpp (Q4_1), reset before every call"
        progress(f"context {context}: {method}, first document")
        request = {
            "model_path": str(embedded_model_file()), "n_ctx": n_ctx, "threads": threads(), "flash_attn": False,
            "reset_every_call": True, "reviews": replays[:1], "probes": [],
        }  # fmt: skip
        result = _llamacpp_side(options, request, method)
        rows.append(llama_cpp_row(context, method, result, gguf_format="Q4_1"))
    return rows


SERVER_SLOTS = 1
"""llama-server's configuration for this workload: one slot, which keeps the document for every call. With 15
slots each slot prefills the document again: their review measured 9-13x slower than 1 slot (commit 6b2e276),
and their 15-agent decode, even with the document put into every slot first, re-evaluated it in 13 of 15 slots
and took 499 s for 15 x 32 tokens at 4,096 tokens (the server's log in the run at fcca843)."""


def llama_server_row(
    binary: Path, gguf: Path, fmt: str, context: int, replays: list, probe_ids: list, max_tokens: int,
    progress: Progress,
) -> dict[str, Any]:  # fmt: skip
    """llama-server's row at ``context`` on the file ``gguf`` (of format ``fmt``): one slot (:data:`SERVER_SLOTS`),
    the review, then the many-agent decode, the slot holding the document before the decode is timed."""
    from benchmarks.studies.llama_server import (
        LlamaServer,
        aggregate_decode,
        replay_review,
        server_peak_rss_bytes,
        warm_slots,
    )

    method = f"llama-server ({fmt}), 1 slot, prompt cache"
    progress(f"context {context}: {method}")
    with LlamaServer(binary, gguf, slots=SERVER_SLOTS, ctx_per_slot=replay_context(replays, max_tokens),
                     threads=threads(), flash_attn=True) as server:  # fmt: skip
        server.complete(replays[0][0]["input_ids"][:64], 2)  # warm-up
        reviews = [replay_review(server, replay) for replay in replays]
        aggregates = []
        for ids in probe_ids:
            warm_slots(server, ids["document_ids"], SERVER_SLOTS)
            aggregates.append(aggregate_decode(server, ids["agent_prompts"], max_tokens))
        rss_peak = server_peak_rss_bytes(server)
    samples = {**review_samples(reviews), "decode_tok_s_15": [a["decode_tok_s_15"] for a in aggregates]}
    first = reviews[0]
    return engine_row(
        context, method, samples, **_review_extra(reviews), prompt_tokens_evaluated=first["prompt_tokens_evaluated"],
        prompt_tokens=first["prompt_tokens"], rss_peak_bytes=rss_peak, slots_warmed=True, gguf_format=fmt,
        aggregate_prompt_tokens_evaluated=[a["aggregate_prompt_tokens_evaluated"] for a in aggregates],
    )  # fmt: skip


def threads() -> int:
    """The threads torch runs on here: the count every llama.cpp side is given too."""
    import torch

    return torch.get_num_threads()


def run_peers(options: PeersOptions, progress: Progress = lambda _: None) -> SuiteResult:
    import llama_cpp  # noqa: F401  (the [peers] extra: fail before anything is measured)

    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.model.loading import embedded_model_file

    workflow = load_workflow("document_review", options.graphs)
    roles = [*workflow.ROLE_PROMPTS, "procurement", "quality", "audit", "strategy", "data"][:AGENTS]
    texts = pydoc_documents(options.documents, chars_per_document=60_000)
    rows: list[dict[str, Any]] = []
    for context in options.contexts:
        ours, replays, probe_ids = _ours(options, context, texts, roles, progress)
        rows += ours + _llama_cpp(options, context, replays, probe_ids, progress)
        if options.llama_server is not None:
            server = llama_server_row(options.llama_server, embedded_model_file(), "Q4_1", context, replays,
                                      probe_ids, options.max_tokens, progress)  # fmt: skip
            rows.append(server)
    from polykv_agents.bench.suite import load_model_for

    model, tokenizer = load_model_for(None)  # after every timed process: the compression rows and RunInfo
    rows += compression_rows(model, tokenizer, options, progress)
    return SuiteResult(
        suite="peers",
        info=RunInfo.collect(model),
        settings={
            "contexts": list(options.contexts),
            "roles": AGENTS,
            "max_tokens": options.max_tokens,
            "documents": options.documents,
            "model_file": embedded_model_file().name,
            "gguf_f16": options.gguf_f16 is not None,
            "llama_cpp_python": installed_version("llama-cpp-python"),
            "llama_server": options.llama_server is not None,
            "compression_documents": options.compression_documents,
            "weights": list(options.weights),
            "compiled": list(options.compiled),
            "our_fixed_method": OUR_FIXED_METHOD,
            "continuation_tokens": CONTINUATION_TOKENS,
        },
        rows=rows,
        summary={},
    )


CONTINUATION_TOKENS = 512
QUANTIZED_CACHE_BITS = (4, 2)
OUR_PRESETS = ("default", "max")


def compression_rows(model, tokenizer, options: PeersOptions, progress: Progress) -> list[dict[str, Any]]:
    """Per context: bytes and PPL delta of QuantizedCache at each bit width and of each preset's pool, mean and
    interval over the same texts (the document is the sample)."""
    from benchmarks.studies.hf_quantized import quantized_cache_perplexity
    from polykv_agents.bench.stats import mean_interval
    from polykv_agents.config import CompressionConfig
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.eval.perplexity import perplexity_deltas

    if options.compression_documents == 0:
        return []
    texts = pydoc_documents(options.compression_documents)
    samples: dict[tuple[int, str], list[tuple[float, int, int]]] = {}  # (delta %, kv bytes, fp16 bytes)
    for context in options.contexts:
        for index, text in enumerate(texts):
            progress(f"context {context}: compression peer, text {index + 1}/{len(texts)}")
            ours = perplexity_deltas(
                model, tokenizer, text, context_tokens=context, continuation_tokens=CONTINUATION_TOKENS,
                configs=[CompressionConfig.preset(name) for name in OUR_PRESETS],
            )  # fmt: skip
            for name, result in zip(OUR_PRESETS, ours, strict=True):
                sample = (result.delta_pct, result.pool_nbytes, result.fp16_nbytes)
                samples.setdefault((context, f"polykv_agents, {name} preset ({result.config})"), []).append(sample)
            for bits in QUANTIZED_CACHE_BITS:
                peer = quantized_cache_perplexity(
                    model, tokenizer, text, context_tokens=context, continuation_tokens=CONTINUATION_TOKENS, nbits=bits
                )
                sample = (peer["delta_pct"], peer["kv_bytes"], peer["fp16_kv_bytes"])
                samples.setdefault((context, f"transformers QuantizedCache, quanto, {bits}-bit"), []).append(sample)
    rows = []
    for (context, method), values in samples.items():
        interval = mean_interval([delta for delta, _, _ in values])
        kv_bytes, fp16_bytes = values[0][1], values[0][2]
        rows.append(
            {
                "kind": "compression",
                "context_tokens": context,
                "method": method,
                "kv_bytes": kv_bytes,
                "ratio_vs_fp16": fp16_bytes / kv_bytes,
                "delta_pct_mean": interval.mean,
                "delta_pct_ci_low": interval.low,
                "delta_pct_ci_high": interval.high,
                "delta_pct_per_document": [delta for delta, _, _ in values],
                "documents": interval.n,
            }
        )
    return rows


def installed_version(distribution: str) -> str | None:
    """``distribution``'s installed version, or ``None`` where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def readme_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's table: each method's review wall, TTFT, decode and prefill speed, peak RSS, per context."""

    def cell(row: dict, key: str, fmt: str) -> str:
        return "—" if row.get(key) is None else fmt.format(row[key])

    lines = [
        "| context | method | review wall | TTFT scratch / cold / warm | decode tok/s, 1 / 15 agents | prefill tok/s "
        "| peak RSS |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    engines = [r for r in result.rows if r["kind"] == "engine"]
    for r in engines:
        lines.append(
            f"| {r['context_tokens']:,} | {r['method']} | {cell(r, 'review_wall_s', '{:.1f} s')} "
            f"| {cell(r, 'ttft_scratch_s', '{:.2f}')} / {cell(r, 'ttft_cold_s', '{:.2f}')} / "
            f"{cell(r, 'ttft_warm_s', '{:.2f} s')} "
            f"| {cell(r, 'decode_tok_s', '{:.1f}')} / {decode_15_text(r, result.settings['roles'])} "
            f"| {cell(r, 'prefill_tok_s', '{:.0f}')} | {r['rss_peak_bytes'] / 2**20:,.0f} MiB |"
        )
    f16 = result.settings.get("gguf_f16", False)
    lines += ["", formats_note(result.settings["model_file"], result.info.dtype, f16)]
    server = [r for r in engines if r["method"].startswith("llama-server")]
    if server:
        lines += ["", llama_server_decode_note(result.settings["roles"], server)]
    compiled = [r for r in engines if r.get("compiled_decode") and r["context_tokens"] == engines[0]["context_tokens"]]
    for r in compiled:
        lines += [
            "",
            f"{r['method']}: the warm-up review (a 256-token document, 3 roles), in which the prefetch node compiled "
            f"the decode step for every batch bucket, took {r['warm_up_s']:.0f} s, once per process.",
        ]
    largest = max(r["context_tokens"] for r in engines)
    lines += ["", f"Where each side stands at {largest:,} tokens {winners_caption(result.settings)}:", ""]
    lines += winners_lines([r for r in engines if r["context_tokens"] == largest])
    compression = [r for r in result.rows if r["kind"] == "compression"]
    if compression:
        lines += ["", "Against transformers' own `QuantizedCache` (quanto), same texts and protocol:", ""]
        lines.append(compression_table(compression))
    return {"peers": "\n".join(lines)}


def _measure(options: PeersOptions, progress: Progress) -> SuiteResult:
    return run_peers(options, progress)


SUITE = TableSuite(
    "peers",
    "llama.cpp (llama-cpp-python, llama-server) against the pooled review, side by side: same weights (the GGUF's "
    "Q4_1 as stored, and an F16 file of them, on llama.cpp; de-quantised on ours), prompts, documents, work; "
    "every method in its own process.",
    PeersOptions,
    _measure,
    write_peers,
    command=(
        "python -m benchmarks peers --llama-server LLAMA_SERVER --gguf-f16 GGUF_F16 --weights auto --weights native "
        "--compiled auto"
    ),
    blocks=readme_blocks,
    reproduce=(),  # needs the [peers] extra and a llama-server binary: benchmarks/run_all.sh runs it when given one
)
