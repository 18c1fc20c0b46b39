"""``python -m benchmarks peers``: what else a user could run, measured side by side in one run.

Same machine, same model file (the embedded GGUF), same prompts in the same order, greedy, the same
number of tokens decoded per call. Not the same weight format: llama.cpp computes with the file's Q4_1
matrices as stored, ours de-quantises them (bf16, or int8/int4 with ``--weights``;
:func:`~benchmarks.studies.peers_writer.formats_note`):

- **polykv_agents**: the 15-role document-review graph with one pool (graphs/document_review.py), its
  calls recorded token for token (:class:`~benchmarks.studies.recording.RecordingEngine`);
- **llama.cpp** through llama-cpp-python (the engine behind LangChain's ``ChatLlamaCpp``), in a fresh
  process (:mod:`benchmarks.studies.llamacpp_side`): the recorded calls replayed one after another over
  one context, so its automatic prefix reuse keeps the document; flash attention off and on; and, at
  the smallest context, with a reset before every call (re-prefilling, as without prefix reuse);
- **llama-server** (llama.cpp's own server, built from the same sources), one slot per role, unified
  KV cache and prompt cache (:mod:`benchmarks.studies.llama_server`): the specialists sent at once.

Besides the review's wall and per-stage time: time to first token cold and warm, single-stream and
15-agent decode speed, prefill speed, peak RSS per method (llama.cpp in processes of their own, ours
sampled around its own work) and the KV bytes each holds for the document.

The compression peer is transformers' own ``QuantizedCache`` (quanto backend, 4 and 2 bits,
:mod:`benchmarks.studies.hf_quantized`): its bytes and perplexity delta against this project's presets,
on the same texts, contexts and protocol (``kind="compression"`` rows; the engines' rows are
``kind="engine"``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import Field, FilePath, field_validator, model_validator

from benchmarks.studies.peers_writer import (
    compression_table,
    decode_15_text,
    formats_note,
    llama_server_decode_note,
    winners_lines,
    write_peers,
)
from benchmarks.studies.side_process import run_side
from benchmarks.studies.workflows import LANGGRAPH_JSON
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, SuiteResult
from polykv_agents.bench.suite import SuiteOptions, TableSuite
from polykv_agents.model.weights import check_weights

LLAMACPP_SIDE = Path(__file__).with_name("llamacpp_side.py")
AGENTS = 15


class PeersOptions(SuiteOptions):
    contexts: list[int] = Field(default=[2048, 4096], json_schema_extra={"flag": "--context"})
    """Document tokens (repeatable)."""
    max_tokens: int = Field(default=32, ge=1)
    """Tokens every free-text answer decodes (EOS ignored), for every method."""
    repetitions: int = Field(default=2, ge=1)
    """Review runs of the pooled graph per context (median); llama.cpp replays the last one's calls."""
    llama_server: FilePath | None = None
    """The llama-server binary (built from the llama-cpp-python sdist's llama.cpp, see docs/RESULTS.md);
    without it the server is not measured."""
    reset_baseline: bool = True
    """Also replay with a reset before every call (re-prefilling) at the smallest context."""
    compression_documents: int = Field(default=3, ge=0)
    """Texts for the compression peer (bytes and PPL of transformers' QuantizedCache vs the presets); 0: skip."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists graphs/document_review.py."""
    weights: list[str] = Field(default=["native"], min_length=1)
    """How our model stores its weights (native, int8, int4), one set of our rows each (repeatable); llama.cpp
    replays the calls of the first."""
    compiled: list[str] = Field(default=[])
    """Weights settings (of ``--weights``) measured once more with the compiled decode step (repeatable), its
    compilation done in the warm-up, as the prefetch node does it once per process; its seconds are reported."""

    @field_validator("weights", "compiled")
    @classmethod
    def _known_weights(cls, value: list[str]) -> list[str]:
        return [check_weights(weights) for weights in value]

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


def _llamacpp(request: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    """Run :mod:`llamacpp_side` on ``request`` in a fresh process; its result."""
    return run_side(LLAMACPP_SIDE, request, what="the llama.cpp run", timeout_s=timeout_s)


def _single_stream(agent, question: str, tokens: int) -> float:
    """Decode tokens per second of one agent after its first token (prefix resident)."""
    from polykv_agents.sampling.settings import GenerationSettings

    settings = GenerationSettings(max_new_tokens=tokens + 1, ignore_eos=True)
    first = 0.0
    for count, _ in enumerate(agent.generate_ids(question, settings), start=1):
        if count == 1:
            first = time.perf_counter()
    return tokens / (time.perf_counter() - first)


def _tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds


def our_method(weights: str, compiled: bool = False) -> str:
    """The method name of our rows with ``weights``, and the compiled decode step or not."""
    return (
        "polykv_agents (one pool)"
        + ("" if weights == "native" else f", {weights} weights")
        + (", compiled decode" if compiled else "")
    )


def _ours_probe(model, tokenizer, document: str, context: int, decode_tokens: int, compiled: bool) -> tuple[dict, dict]:
    """Our figures outside the graph, and the token ids llama.cpp's probe reads (the same ones)."""
    import torch

    from polykv_agents.agent import PooledAgent
    from polykv_agents.bench.agents import role_prompts, run_batched
    from polykv_agents.bench.stats import median_after_warmup
    from polykv_agents.bench.ttft import ttft_pool_cold, ttft_pool_warm, ttft_reprefill
    from polykv_agents.engine import Engine
    from polykv_agents.pool.prefill import prefill_cache
    from polykv_agents.pool.shared_pool import SharedKVPool
    from polykv_agents.sampling.settings import GenerationSettings

    pool = SharedKVPool.prefill(model, tokenizer, document)

    def prefill_seconds() -> float:
        started = time.perf_counter()
        prefill_cache(model, pool.token_ids)
        return time.perf_counter() - started

    prefill_s = median_after_warmup(1, prefill_seconds)
    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0, compile_decode=compiled)
    engine.warm_up_decode(model, tokenizer, pool)  # with compiled: the graph engine's model has its graphs
    roles = role_prompts(AGENTS)
    agents = [PooledAgent(pool, model, tokenizer, system_prompt=r, engine=engine) for r, _ in roles]
    questions = [q for _, q in roles]
    ttft_cold = median_after_warmup(1, lambda: ttft_pool_cold(pool, model, tokenizer, roles[0][0], questions[0]))
    ttft_warm = ttft_pool_warm(agents[1], questions[1])
    prompt = agents[0].prompt_ids(questions[0])
    ttft_scratch = median_after_warmup(1, lambda: ttft_reprefill(model, pool, prompt))
    single = median_after_warmup(1, lambda: _single_stream(agents[0], questions[0], decode_tokens))
    settings = GenerationSettings(max_new_tokens=decode_tokens, ignore_eos=True)
    aggregate = median_after_warmup(1, lambda: _tokens_per_s(*run_batched(agents, questions, settings)))
    scheduler = engine.schedulers.scheduler_for(model, tokenizer, pool, "decompressed")
    resident = pool.nbytes + scheduler.prefix.peak_decoded_nbytes
    if compiled:  # figures labelled compiled must not come from eager steps
        engine.schedulers.require_compiled()
    engine.close()
    figures = {
        "prefill_tok_s": pool.num_tokens / prefill_s,
        "ttft_scratch_s": ttft_scratch,
        "ttft_cold_s": ttft_cold,
        "ttft_warm_s": ttft_warm,
        "decode_tok_s": single,
        "decode_tok_s_15": aggregate,
        "kv_bytes": pool.nbytes,
        "kv_bytes_resident": resident,
        "kv_note": f"pool {pool.nbytes / 2**20:.1f} MiB; while decoding, + the prefix decoded to {model.dtype}",
    }
    probe = {
        "document_ids": pool.token_ids.tolist(),
        "prompt_ids": agents[0].prompt_ids(questions[0]).tolist(),
        "other_prompt_ids": agents[1].prompt_ids(questions[1]).tolist(),
        "decode_tokens": decode_tokens,
        "agent_prompts": [
            torch.cat([pool.token_ids, a.prompt_ids(q)]).tolist() for a, q in zip(agents, questions, strict=True)
        ],
    }
    return figures, probe


PROBE_FIGURES = ("ttft_scratch_s", "ttft_cold_s", "ttft_warm_s", "decode_tok_s", "decode_tok_s_15", "prefill_tok_s")


def _row(context: int, method: str, review: dict | None, probe: dict | None, **extra: Any) -> dict[str, Any]:
    review = review or {}
    stage = review.get("stage_s", {})
    return {
        "kind": "engine",
        "context_tokens": context,
        "method": method,
        "review_wall_s": review.get("wall_s"),
        "prefetch_s": stage.get("prefetch", 0.0) if review else None,
        "planner_s": stage.get("planner"),
        "specialist_s": stage.get("specialist"),
        "critic_s": stage.get("critic"),
        "summarizer_s": stage.get("summarizer"),
        "review_calls": review.get("calls"),
        "review_output_tokens": review.get("output_tokens"),
        **{key: (probe or {}).get(key) for key in PROBE_FIGURES},
        **extra,
    }


def run_peers(options: PeersOptions, progress: Progress = lambda _: None) -> SuiteResult:
    import llama_cpp  # noqa: F401  (the [peers] extra: fail before anything is measured)
    import torch

    from benchmarks.studies.graph_e2e import _document, graphs_under_test, run_graph
    from benchmarks.studies.llama_server import LlamaServer, aggregate_decode
    from benchmarks.studies.llama_server import replay_review as server_review
    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.bench.rss import PeakRss
    from polykv_agents.bench.suite import load_model_for
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.model.loading import embedded_model_file

    workflow = load_workflow("document_review", options.graphs)
    model, tokenizer = load_model_for(None)
    gguf = embedded_model_file()
    threads = torch.get_num_threads()
    roles = [*workflow.ROLE_PROMPTS, "procurement", "quality", "audit", "strategy", "data"][:AGENTS]
    text = pydoc_documents(1, chars_per_document=60_000)[0]
    graphs = {
        variant: graphs_under_test(workflow, options.max_tokens, *variant)["pooled"] for variant in options.variants()
    }
    progress("warm-up")
    warm_up_s = {}
    for variant, (graph, engine) in graphs.items():
        started = time.perf_counter()
        run_graph(graph, engine, _document(tokenizer, text, 256, run=-1), roles[:3])
        # With the compiled step, the prefetch node compiled every batch bucket (cold or from the Inductor cache).
        warm_up_s[variant] = time.perf_counter() - started
    rows: list[dict[str, Any]] = []
    run_index = 0
    for context in options.contexts:
        recorded = {}
        for (weights, compiled), (graph, engine) in graphs.items():
            runs = []
            for _ in range(options.repetitions):
                run_index += 1
                progress(f"context {context}: {our_method(weights, compiled)} review, run {run_index}")
                with PeakRss() as rss:
                    document = _document(tokenizer, text, context, 1000 + run_index)
                    run, recorded[weights, compiled] = run_graph(graph, engine, document, roles)
                runs.append((run, rss.peak_bytes))
            progress(f"context {context}: {our_method(weights, compiled)} probe")
            with PeakRss() as rss:
                ours, probe = _ours_probe(
                    engine.load_model(None, weights=weights)[0], tokenizer, _document(tokenizer, text, context, 0),
                    context, options.max_tokens, compiled,
                )  # fmt: skip
            median_run = sorted(runs, key=lambda r: r[0].wall_s)[len(runs) // 2]
            review = {
                "wall_s": statistics.median(r.wall_s for r, _ in runs),
                "stage_s": {s: statistics.median(r.stage_s[s] for r, _ in runs) for s in median_run[0].stage_s},
                "calls": median_run[0].calls,
                "output_tokens": median_run[0].output_tokens,
            }
            rows.append(
                _row(context, our_method(weights, compiled), review, ours, rss_peak_bytes=max(max(p for _, p in runs),
                     rss.peak_bytes), kv_bytes=ours["kv_bytes"], kv_bytes_resident=ours["kv_bytes_resident"],
                     weights=weights, compiled_decode=compiled, warm_up_s=warm_up_s[weights, compiled])
            )  # fmt: skip
        calls = recorded[options.weights[0], False]
        replay = [{"node": c.node, "input_ids": c.input_ids, "output_tokens": c.output_tokens} for c in calls]
        n_ctx = max(len(c["input_ids"]) for c in replay) + options.max_tokens + 64
        llama_probe = {k: probe[k] for k in ("document_ids", "prompt_ids", "other_prompt_ids", "decode_tokens")}
        for flash in (False, True):
            progress(f"context {context}: llama.cpp, flash attention {'on' if flash else 'off'}")
            result = _llamacpp({
                "model_path": str(gguf), "n_ctx": n_ctx, "threads": threads, "flash_attn": flash,
                "reset_every_call": False, "review": replay, "probe": llama_probe,
            })  # fmt: skip
            rows.append(
                _row(context, f"llama.cpp, prefix reuse, flash attention {'on' if flash else 'off'}",
                     result["review"], result["probe"], rss_peak_bytes=result["rss_peak_bytes"],
                     kv_bytes=result["probe"]["state_bytes"], kv_bytes_resident=result["probe"]["state_bytes"])
            )  # fmt: skip
        if options.reset_baseline and context == min(options.contexts):
            progress(f"context {context}: llama.cpp, reset before every call")
            result = _llamacpp({
                "model_path": str(gguf), "n_ctx": n_ctx, "threads": threads, "flash_attn": False,
                "reset_every_call": True, "review": replay, "probe": None,
            })  # fmt: skip
            rows.append(_row(context, "llama.cpp, reset before every call", result["review"], None,
                             rss_peak_bytes=result["rss_peak_bytes"]))  # fmt: skip
        for slots in (AGENTS, 1) if options.llama_server is not None else ():
            # 15 slots decode the parallel specialists in one batch but each slot holds its own copy of the
            # document; 1 slot queues them over one context that keeps the document.
            progress(f"context {context}: llama-server, {slots} slot(s)")
            with LlamaServer(options.llama_server, gguf, slots=slots, ctx_per_slot=n_ctx, threads=threads,
                             flash_attn=True) as server:  # fmt: skip
                server.complete(replay[0]["input_ids"][:64], 2)  # warm-up
                result = server_review(server, replay)
                aggregate = aggregate_decode(server, probe["agent_prompts"], options.max_tokens)
            rows.append(
                _row(context, f"llama-server, {slots} slot{'s' if slots > 1 else ''}, prompt cache", result,
                     {"decode_tok_s_15": aggregate}, rss_peak_bytes=result["rss_peak_bytes"],
                     prompt_tokens_evaluated=result["prompt_tokens_evaluated"], prompt_tokens=result["prompt_tokens"])
            )  # fmt: skip
    rows += compression_rows(model, tokenizer, options, progress)
    return SuiteResult(
        suite="peers",
        info=RunInfo.collect(model),
        settings={
            "contexts": list(options.contexts),
            "roles": AGENTS,
            "max_tokens": options.max_tokens,
            "repetitions": options.repetitions,
            "model_file": gguf.name,
            "llama_cpp_python": _version("llama-cpp-python"),
            "llama_server": options.llama_server is not None,
            "compression_documents": options.compression_documents,
            "weights": list(options.weights),
            "compiled": list(options.compiled),
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


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


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
    lines += ["", formats_note(result.settings["model_file"], result.info.dtype)]
    if any(r["method"].startswith("llama-server") for r in engines):
        lines += ["", llama_server_decode_note(result.settings["roles"])]
    compiled = [r for r in engines if r.get("compiled_decode") and r["context_tokens"] == engines[0]["context_tokens"]]
    for r in compiled:
        lines += [
            "",
            f"{r['method']}: the warm-up review (a 256-token document, 3 roles), in which the prefetch node compiled "
            f"the decode step for every batch bucket, took {r['warm_up_s']:.0f} s, once per process.",
        ]
    largest = max(r["context_tokens"] for r in engines)
    lines += ["", f"Where each side stands at {largest:,} tokens (the winner of each measure, and by how much):", ""]
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
    "llama.cpp (llama-cpp-python, llama-server) against the pooled review, side by side: same GGUF file (its Q4_1 "
    "weights as stored on llama.cpp, de-quantised on ours), prompts, work.",
    PeersOptions,
    _measure,
    write_peers,
    command=(
        "python -m benchmarks peers --llama-server LLAMA_SERVER --weights native --weights int8 --weights int4 "
        "--compiled int8"
    ),
    blocks=readme_blocks,
    reproduce=(),  # needs the [peers] extra and a llama-server binary: benchmarks/run_all.sh runs it when given one
)
