"""``python -m benchmarks graph_e2e``: the 15-role document-review graph with one shared pool vs the same
graph re-prefilling the document in every call, doing equal work.

Both graphs are graphs/document_review.py with the same roles, prompts and greedy chat model; the
baseline (:class:`~benchmarks.studies.baselines.ReprefillDocument`) prefills the whole document again
in every call (planner, 15 specialists, critic, summarizer), as a plain local chat model does, with the
chunked prefill the time-to-first-token baseline times (its engine is a
:class:`~benchmarks.studies.baselines.ReprefillEngine`). It has neither prefix reuse nor batching: its calls
have no pool to share, so each decodes alone (llama.cpp, in the peers study, is the re-prefilling peer with
prefix reuse, and llama-server the batched one).

Equal work: every free-text answer decodes exactly ``max_tokens`` tokens (``ignore_eos``), and the
planner decodes the same plan under both methods: its schema pins every focus (:func:`equal_plan`),
since a compressed and a full-precision document otherwise lead the greedy model to different plans
of different lengths (measured: 99-109 against 262-275 tokens). The JSON records that the plans
matched. Calls and tokens are counted from the run itself (a :class:`RecordingEngine` sees every
decoded call), and each stage's time (prefetch, planner, specialists, critic, summarizer) comes from
the graph's own stream of node updates. The pooled graph builds its pool inside each run (a fresh
document variant per run, so nothing is reused across runs). One warm-up run of each on a short
document first; then the median per context, with every run kept in the JSON.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, Field

from benchmarks.studies.baselines import PinnedPlanPrefetch, PinnedPlanReprefill, ReprefillEngine
from benchmarks.studies.recording import RecordedCall, RecordingEngine
from benchmarks.studies.workflows import LANGGRAPH_JSON, load_workflow
from polykv_agents.bench.output import Progress
from polykv_agents.bench.provenance import Provenance
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for
from polykv_agents.model.weights import Weights

logger = logging.getLogger(__name__)

EXTRA_ROLES = ["procurement", "quality", "audit", "strategy", "data"]

STAGES = ("prefetch", "planner", "specialist", "critic", "summarizer")
"""The review's stages, in order; each one's time ends when its last node update arrives."""


class GraphE2EOptions(SuiteOptions):
    contexts: list[int] = Field(default=[2048, 4096], json_schema_extra={"flag": "--context"})
    """Document tokens (repeatable)."""
    roles: int = Field(default=15, ge=1, le=15)
    """Specialists the planner assigns."""
    max_tokens: int = Field(default=32, ge=1)
    """Tokens every free-text answer decodes (EOS ignored)."""
    repetitions: int = Field(default=2, ge=1)
    """Timed runs per context after one warm-up."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists graphs/document_review.py."""
    weights: Weights = "native"
    """How the model stores its weights, for both graphs (native, int8, int4)."""
    compile_decode: bool = False
    """Both graphs' engines compile their decode steps (compiled in the warm-up run's prefetch node)."""


class StageCalls(BaseModel):
    """What one stage of one run decoded, counted from the calls themselves."""

    calls: int
    input_tokens: int
    pool_tokens: int
    output_tokens: int


class GraphRun(BaseModel):
    """One run of one graph."""

    wall_s: float
    stage_s: dict[str, float]
    stages: dict[str, StageCalls]
    plan: list[dict[str, str]]

    @property
    def output_tokens(self) -> int:
        return sum(stage.output_tokens for stage in self.stages.values())

    @property
    def calls(self) -> int:
        return sum(stage.calls for stage in self.stages.values())


class GraphE2EResult(BaseModel):
    """The run's conditions, and every run of every method per context."""

    meta: dict[str, Any]
    runs: dict[str, dict[str, list[GraphRun]]]
    """Context (as a string, for JSON) -> method -> its timed runs."""
    provenance: Provenance
    """Which code ran."""


def equal_plan(roles: Sequence[str]) -> dict[str, str]:
    """The plan every method decodes (pinned by :class:`~benchmarks.studies.baselines.PinnedPlan`)."""
    return {role: f"what the document means for {role}" for role in roles}


def _document(tokenizer, text: str, tokens: int, run: int) -> str:
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:tokens]
    return f"(Review copy {run}.)\n" + tokenizer.decode(ids, skip_special_tokens=True)


def stage_of(node: str) -> str:
    return node if node in STAGES else "other"


def count_calls(calls: list[RecordedCall]) -> dict[str, StageCalls]:
    """Calls and tokens per stage."""
    stages: dict[str, StageCalls] = {}
    for call in calls:
        stage = stages.setdefault(
            stage_of(call.node), StageCalls(calls=0, input_tokens=0, pool_tokens=0, output_tokens=0)
        )
        stage.calls += 1
        stage.input_tokens += len(call.input_ids)
        stage.pool_tokens += call.pool_tokens
        stage.output_tokens += call.output_tokens
    return stages


def run_graph(graph, engine: RecordingEngine, document: str, roles: list[str]) -> tuple[GraphRun, list[RecordedCall]]:
    """One timed run: wall time, each stage's time from the graph's node updates, and the calls it decoded."""
    engine.take_calls()
    finished: dict[str, float] = {}
    state: dict[str, Any] = {}
    started = time.perf_counter()
    for mode, chunk in graph.stream({"document": document, "roles": roles}, stream_mode=["updates", "values"]):
        if mode == "updates":
            for node in chunk:
                finished[node] = time.perf_counter() - started  # a stage ends with its last update
        else:
            state = chunk
    wall = time.perf_counter() - started
    stage_s, previous = {}, 0.0
    for stage in STAGES:
        stage_s[stage] = finished[stage] - previous
        previous = finished[stage]
    calls = engine.take_calls()
    run = GraphRun(
        wall_s=wall,
        stage_s=stage_s,
        stages=count_calls(calls),
        plan=[dict(entry) for entry in state.get("plan", [])],
    )
    return run, calls


class RecordingReprefillEngine(RecordingEngine, ReprefillEngine):
    """The baseline's engine: each call's prompt prefilled by the pool's chunked prefill, every call recorded."""


def graphs_under_test(
    workflow: ModuleType,
    max_tokens: int,
    weights: Weights = "native",
    compile_decode: bool = False,
    model: str | None = None,
) -> dict[str, tuple[Any, RecordingEngine]]:
    """Method -> (compiled graph, its recording engine): the same chat settings (``model``, default the embedded
    one, and ``weights`` among them) and engine settings (``compile_decode``) for both; the baseline's engine
    prefills each call with the chunked prefill (:class:`~benchmarks.studies.baselines.ReprefillEngine`)."""
    from polykv_agents.chat.chat_model import ChatPolyKV

    built = {}
    methods = (
        ("pooled", PinnedPlanPrefetch, RecordingEngine),
        ("reprefill", PinnedPlanReprefill, RecordingReprefillEngine),
    )
    for method, prefetch, engine_type in methods:
        engine = engine_type(compile_decode=compile_decode)
        chosen = {} if model is None else {"model": model}
        chat = ChatPolyKV(**chosen, max_tokens=max_tokens, ignore_eos=True, engine=engine, weights=weights)
        built[method] = (workflow.build_graph(prefetch=prefetch(chat, engine=engine, plan=equal_plan)), engine)
    return built


def run_graph_e2e(options: GraphE2EOptions, progress: Progress = lambda _: None) -> GraphE2EResult:
    """Time both graphs per context, alternating methods run by run."""
    import torch

    from polykv_agents.bench.environment import RunInfo
    from polykv_agents.eval.corpus import pydoc_documents

    workflow = load_workflow("document_review", options.graphs)
    model, tokenizer = load_model_for(None)  # the graphs' chat model loads the same embedded model
    roles = [*workflow.ROLE_PROMPTS, *EXTRA_ROLES][: options.roles]
    text = pydoc_documents(1, chars_per_document=60_000)[0]
    graphs = graphs_under_test(workflow, options.max_tokens, options.weights, options.compile_decode)
    progress("warm-up")
    for graph, engine in graphs.values():  # load, first forward passes, scheduler thread
        run_graph(graph, engine, _document(tokenizer, text, 256, run=-1), roles[:3])
    runs: dict[str, dict[str, list[GraphRun]]] = {}
    run_index = 0
    for context in options.contexts:
        by_method: dict[str, list[GraphRun]] = {method: [] for method in graphs}
        for _ in range(options.repetitions):
            for method, (graph, engine) in graphs.items():
                run_index += 1
                progress(f"context {context}: {method}, run {run_index}")
                run, _ = run_graph(graph, engine, _document(tokenizer, text, context, run_index), roles)
                if options.compile_decode and method == "pooled":  # checked before its schedulers retire (15 s)
                    engine.schedulers.require_compiled()  # a run labelled compiled must not have decoded eager
                by_method[method].append(run)
                logger.info("context=%d %s: %.1f s", context, method, run.wall_s)
        runs[str(context)] = by_method
    info = RunInfo.collect(model)
    meta = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": info.torch,
        "model": info.model,
        "dtype": info.dtype,
        "roles": len(roles),
        "max_tokens": options.max_tokens,
        "repetitions": options.repetitions,
        "weights": options.weights,
        "compile_decode": options.compile_decode,
        "warmup_runs": 1,
        "document": "pydoc_data.topics (CPython), first 60k characters, cut to the context length",
        "reprefill_prefill": "chunked",
    }
    return GraphE2EResult(meta=meta, runs=runs, provenance=Provenance.of_this_process())


def summary_rows(result: GraphE2EResult) -> list[dict[str, Any]]:
    """One row per (context, method): medians over its runs, and whether the work was equal to the pooled run's."""
    rows = []
    for context, by_method in result.runs.items():
        reference = by_method["pooled"]
        for method, runs in by_method.items():
            wall = statistics.median(r.wall_s for r in runs)
            output = statistics.median(r.output_tokens for r in runs)
            rows.append(
                {
                    "context_tokens": int(context),
                    "method": method,
                    "wall_s": wall,
                    "stage_s": {stage: statistics.median(r.stage_s[stage] for r in runs) for stage in STAGES},
                    "calls": statistics.median(r.calls for r in runs),
                    "output_tokens": output,
                    "ms_per_output_token": 1000 * wall / output,
                    "input_tokens": statistics.median(sum(s.input_tokens for s in r.stages.values()) for r in runs),
                    "pool_tokens": statistics.median(sum(s.pool_tokens for s in r.stages.values()) for r in runs),
                    "same_plan_as_pooled": all(r.plan == p.plan for r, p in zip(runs, reference, strict=True)),
                }
            )
    return rows


def baseline_sentence(meta: dict[str, Any]) -> str:
    """What the re-prefill baseline does and does not do, for captions: no prefix reuse, no batching, and which
    prefill its calls ran (runs before ``reprefill_prefill`` was recorded prefilled each call in one forward)."""
    prefill = (
        "with the chunked prefill the time-to-first-token baseline uses (`prefill_cache`)"
        if meta.get("reprefill_prefill") == "chunked"
        else "in one forward per call, not the chunked prefill the time-to-first-token baseline uses"
    )
    return (
        f"prefills the document in every call, {prefill}. It has neither prefix reuse nor batching: each call "
        "decodes alone, so the ratio is against a plain local chat model, not against an engine that reuses "
        "prefixes (llama.cpp) or batches (llama-server; both in the peers study)."
    )


def legacy_note(meta: dict[str, Any]) -> str | None:
    """A caption's warning for a float32 run that records no weights setting (made before ``--weights``, the
    compute thread's bf16 default and the prefix tree), or ``None``."""
    if meta.get("dtype") != "float32" or "weights" in meta:
        return None
    return (
        "**Before today's runtime:** a float32 run made before the compute thread, int8 weights and the prefix "
        "tree; it will be re-run with them. Runs at 4,096 tokens in bf16 with int8 weights, with and without the "
        "prefix tree, are kept in `benchmarks/results/issue16/` (README there)."
    )


def results_lines(result: GraphE2EResult) -> list[str]:
    """The section of docs/RESULTS.md."""
    meta = result.meta
    rows = summary_rows(result)
    lines = [
        "## End to end: the document-review graph",
        "",
        "Produced by `python -m benchmarks graph_e2e --context 2048 --context 4096"
        + (f" --weights {meta['weights']}" if meta.get("weights", "native") != "native" else "")
        + (" --compile-decode true" if meta.get("compile_decode") else "")
        + "`.",
        "",
        f"Machine: {meta['machine']}, torch {meta['torch']}. Model: {meta['model']} ({meta['dtype']}, "
        f"{meta.get('weights', 'native')} weights{', compiled decode steps' if meta.get('compile_decode') else ''}"
        "). "
        f"{meta['roles']} roles: planner (typed plan, pinned to the same plan for both methods), specialists in "
        "parallel, critic, "
        f"summarizer; every free-text answer decodes exactly {meta['max_tokens']} tokens (EOS ignored). Calls and "
        "tokens are counted from the run; stage times come from the graph's stream of node updates. Median of "
        f"{meta['repetitions']} runs after {meta['warmup_runs']} warm-up, every run in graph_e2e.json. "
        f"Document: {meta['document']}. {result.provenance.commit_sentence()} "
        "The pooled graph builds its pool inside every run; the re-prefill graph "
        f"(`build_graph(prefetch=ReprefillDocument(chat))`) {baseline_sentence(meta)}",
        *([] if legacy_note(meta) is None else ["", legacy_note(meta)]),
        "",
        "| context | method | wall | prefetch | planner | specialists | critic | summarizer | calls "
        "| output tokens | ms per output token | input tokens (from pool) | same plan |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        stage = r["stage_s"]
        lines.append(
            f"| {r['context_tokens']} | {r['method']} | {r['wall_s']:.1f} s | {stage['prefetch']:.1f} s "
            f"| {stage['planner']:.1f} s | {stage['specialist']:.1f} s | {stage['critic']:.1f} s "
            f"| {stage['summarizer']:.1f} s | {r['calls']:.0f} | {r['output_tokens']:.0f} "
            f"| {r['ms_per_output_token']:.0f} | {r['input_tokens']:,.0f} ({r['pool_tokens']:,.0f}) "
            f"| {'yes' if r['same_plan_as_pooled'] else 'no'} |"
        )
    lines += ["", "| context | speed-up of the pooled graph |", "|---:|---:|"]
    for context, pair in _pairs(rows).items():
        lines.append(f"| {context} | {pair['reprefill']['wall_s'] / pair['pooled']['wall_s']:.1f}x |")
    return lines


def _pairs(rows: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        pairs.setdefault(row["context_tokens"], {})[row["method"]] = row
    return pairs


def readme_summary(result: GraphE2EResult) -> str:
    """The README's sentence: wall times at every context, the largest first."""
    meta = result.meta
    pairs = sorted(_pairs(summary_rows(result)).items(), key=lambda item: -item[0])
    parts = [
        f"{pair['pooled']['wall_s']:.1f} s with one pool against {pair['reprefill']['wall_s']:.1f} s when every call "
        f"prefills the document again at {context:,} tokens "
        f"({pair['reprefill']['wall_s'] / pair['pooled']['wall_s']:.1f}x)"
        for context, pair in pairs
    ]
    calls = pairs[0][1]["pooled"]["calls"]
    note = legacy_note(meta)
    return (
        f"End to end, the {meta['roles']}-role document-review graph ({calls:.0f} calls: the same typed plan, then "
        f"answers of exactly {meta['max_tokens']} tokens each, the same work for both) takes "
        + "; and ".join(parts)
        + f" (`python -m benchmarks graph_e2e`, median of {meta['repetitions']} after a warm-up). "
        + f"The re-prefill baseline {baseline_sentence(meta)}"
        + ("" if note is None else f"\n\n{note}")
    )


class GraphE2ESuite(JsonSuite[GraphE2EResult]):
    name = "graph_e2e"
    summary = "The 15-role document-review graph with one shared pool vs re-prefilling in every call."
    result_type = GraphE2EResult
    options = GraphE2EOptions
    reproduce = (("--context", "2048", "--context", "4096"),)

    def run(self, options: GraphE2EOptions, progress: Progress) -> GraphE2EResult:
        return run_graph_e2e(options, progress)

    def rendered(self, result: GraphE2EResult) -> Rendered:
        return Rendered(results=results_lines(result), blocks={"graph_e2e": readme_summary(result)})


SUITE = GraphE2ESuite()
