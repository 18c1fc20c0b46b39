"""``polykv-agents bench graph_e2e``: the 15-role document-review graph with one shared pool vs the same
graph re-prefilling.

Both graphs are graphs/document_review.py with the same roles, prompts and greedy chat model; the
baseline (:func:`reprefill_graph`) prefills the whole document again in every call (planner, 15
specialists, critic, summarizer), as a plain local chat model does. The pooled graph builds its pool
inside each run (a fresh document variant per run, so nothing is reused across runs). One warm-up run
of each on a short document first; then the median wall time per context.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, Field

from polykv_agents.bench.baselines import ReprefillDocument
from polykv_agents.bench.output import Progress
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for
from polykv_agents.bench.workflows import LANGGRAPH_JSON, load_workflow
from polykv_agents.graph.workflow import role_chat_model

logger = logging.getLogger(__name__)

EXTRA_ROLES = ["procurement", "quality", "audit", "strategy", "data"]

# How the committed graph_e2e.json was made (before the script became this suite); docs/RESULTS.md says so.
PRODUCED_BY = "Produced by `python benchmarks/graph_e2e.py --contexts 4096 --roles 15 --max-tokens 32 --repetitions 2`."


class GraphE2EOptions(SuiteOptions):
    contexts: list[int] = Field(default=[2048, 4096], json_schema_extra={"flag": "--context"})
    """Document tokens (repeatable)."""
    roles: int = Field(default=15, ge=1, le=15)
    """Specialists the planner assigns."""
    max_tokens: int = Field(default=32, ge=1)
    """Tokens per answer."""
    repetitions: int = Field(default=2, ge=1)
    """Timed runs per context after one warm-up."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists graphs/document_review.py."""


class GraphE2EResult(BaseModel):
    """The run's conditions and one row per context."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]


def reprefill_graph(workflow: ModuleType, max_tokens: int):
    """The baseline: the same graph without a pool, every call prefilling the whole document."""
    chat = role_chat_model(None, max_tokens, default_max_tokens=workflow.DEFAULT_MAX_TOKENS)
    return workflow.build_graph(prefetch=ReprefillDocument(chat))


def _document(tokenizer, text: str, tokens: int, run: int) -> str:
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:tokens]
    return f"(Review copy {run}.)\n" + tokenizer.decode(ids, skip_special_tokens=True)


def _run(graph, document: str, roles: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    state = graph.invoke({"document": document, "roles": roles})
    seconds = time.perf_counter() - started
    output_tokens = sum((m.usage_metadata or {}).get("output_tokens", 0) for m in state["messages"])
    return seconds, output_tokens


def run_graph_e2e(options: GraphE2EOptions, progress: Progress = lambda _: None) -> GraphE2EResult:
    """Time both graphs per context; medians of wall time and output tokens."""
    import torch

    from polykv_agents.bench.environment import RunInfo
    from polykv_agents.eval.corpus import pydoc_documents

    workflow = load_workflow("document_review", options.graphs)
    model, tokenizer = load_model_for(None)  # the graphs' chat model loads the same embedded model
    roles = [*workflow.ROLE_PROMPTS, *EXTRA_ROLES][: options.roles]
    text = pydoc_documents(1, chars_per_document=60_000)[0]
    graphs = {
        "pooled": workflow.build_graph(max_tokens=options.max_tokens),
        "reprefill": reprefill_graph(workflow, options.max_tokens),
    }
    progress("warm-up")
    for graph in graphs.values():  # load, first forward passes, scheduler thread
        _run(graph, _document(tokenizer, text, 256, run=-1), roles[:3])
    rows, run = [], 0
    for context in options.contexts:
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in graphs}
        for _ in range(options.repetitions):
            for name, graph in graphs.items():
                run += 1
                progress(f"context {context}: {name}, run {run}")
                samples[name].append(_run(graph, _document(tokenizer, text, context, run), roles))
                logger.info("context=%d %s: %.1f s", context, name, samples[name][-1][0])
        row: dict[str, Any] = {"context_tokens": context, "roles": len(roles), "max_tokens": options.max_tokens}
        for name, values in samples.items():
            row[f"wall_s_{name}"] = statistics.median(v[0] for v in values)
            row[f"output_tokens_{name}"] = statistics.median(v[1] for v in values)
        row["speedup"] = row["wall_s_reprefill"] / row["wall_s_pooled"]
        rows.append(row)
    info = RunInfo.collect(model)
    meta = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": info.torch,
        "model": info.model,
        "dtype": info.dtype,
        "repetitions": options.repetitions,
        "warmup_runs": 1,
        "calls_per_run": len(roles) + 3,
        "document": "pydoc_data.topics (CPython), first 60k characters, cut to the context length",
    }
    return GraphE2EResult(meta=meta, rows=rows)


def results_lines(result: GraphE2EResult) -> list[str]:
    """The section of docs/RESULTS.md."""
    meta = result.meta
    lines = [
        PRODUCED_BY,
        "",
        "## End to end: the document-review graph",
        "",
        f"Machine: {meta['machine']}, torch {meta['torch']}. Model: {meta['model']} ({meta['dtype']}). "
        f"{meta['calls_per_run']} model calls per run (planner, specialists in parallel, critic, summarizer). "
        f"Median of {meta['repetitions']} runs after {meta['warmup_runs']} warm-up. Document: {meta['document']}. "
        "The pooled graph builds its pool inside every run; the baseline (`build_graph(share_pool=False)`) "
        "prefills the document in every call.",
        "",
        "| context | roles | tokens per answer | wall, pooled | wall, re-prefill | speed-up "
        "| output tokens (pooled / re-prefill) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r['context_tokens']} | {r['roles']} | {r['max_tokens']} | {r['wall_s_pooled']:.1f} s "
            f"| {r['wall_s_reprefill']:.1f} s | {r['speedup']:.1f}x | {r['output_tokens_pooled']:.0f} / "
            f"{r['output_tokens_reprefill']:.0f} |"
        )
    return lines


def readme_summary(result: GraphE2EResult) -> str:
    """The README's sentence: wall times at every context, the largest first."""
    rows = sorted(result.rows, key=lambda r: -r["context_tokens"])
    first, rest = rows[0], rows[1:]
    text = (
        f"End to end, the {first['roles']}-role document-review graph ({result.meta['calls_per_run']} calls: the "
        f"planner's typed plan, then {first['max_tokens']}-token answers) takes {first['wall_s_pooled']:.1f} s with "
        f"one pool against {first['wall_s_reprefill']:.1f} s when every call prefills the document again at "
        f"{first['context_tokens']:,} tokens ({first['speedup']:.1f}x)"
    )
    text += "".join(
        f", and {r['wall_s_pooled']:.1f} s against {r['wall_s_reprefill']:.1f} s at {r['context_tokens']:,} "
        f"({r['speedup']:.1f}x)"
        for r in rest
    )
    return text + (f" (`polykv-agents bench graph_e2e`, median of {result.meta['repetitions']} after a warm-up).")


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
