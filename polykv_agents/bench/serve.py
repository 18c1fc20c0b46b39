"""``polykv-agents bench serve``: N review workflows over N different documents, at once, against one after another.

What a LangGraph deployment serving several users gets from one process and one engine. For each N: the
workflows started together in a fresh process (calls over all N pools share one forward per step,
:mod:`polykv_agents.runtime.model_steps`), the same N one after another in another fresh process, and the same N
started together through ``langgraph dev``'s in-memory server (``langgraph_sdk`` clients) in a third. Every
answer decodes exactly ``--max-tokens`` tokens (``ignore_eos`` in the run's context), over the same documents in
every mode, so the work is equal; each mode reports the output tokens it decoded to show it.

Reported per (N, mode): wall time, aggregate output tokens/s, each workflow's latency and time to its first
streamed token (p50, p95), and the process's peak RSS (``VmHWM``, model load included; the server's own process
through the server). The graph comes from a ``langgraph.json`` (``--graphs``, ``--graph``), as ``langgraph dev``
loads it, and takes ``{"document", "roles"}`` (the repository's ``document_review``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import MIB, Column, Progress, SuiteResult, column, write_suite
from polykv_agents.bench.suite import SuiteOptions, TableSuite
from polykv_agents.graph.langgraph_config import LANGGRAPH_JSON

MODE_LABELS: dict[str, str] = {
    "at_once": "in process, at once",
    "one_after_another": "in process, one after another",
    "server": "langgraph dev, at once",
}


class ServeOptions(SuiteOptions):
    workflows: list[int] = Field(default=[1, 2, 4, 8], json_schema_extra={"flag": "--workflows"})
    """How many workflows (each over its own document) to serve at once (repeatable)."""
    modes: list[str] = Field(default=["at_once", "one_after_another", "server"], json_schema_extra={"flag": "--mode"})
    """How to run them (repeatable): at_once, one_after_another (in this process), server (langgraph dev)."""
    context: int = Field(default=2048, ge=16)
    """Document tokens per workflow."""
    roles: int = Field(default=15, ge=1)
    """Roles per review (the specialists decoded in parallel)."""
    max_tokens: int = Field(default=32, ge=1)
    """Tokens every answer decodes (EOS ignored)."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists the graph."""
    graph: str = "document_review"
    """The graph to serve: it takes {"document", "roles"}."""
    model: str | None = None
    """The model every call uses (a run context's ``model``; default: the graph's own, the embedded model)."""

    @field_validator("modes")
    @classmethod
    def _known_modes(cls, modes: list[str]) -> list[str]:
        unknown = [mode for mode in modes if mode not in MODE_LABELS]
        if unknown:
            msg = f"unknown --mode {unknown[0]!r}; choose from {', '.join(MODE_LABELS)}"
            raise ValueError(msg)
        return modes


def run_worker(request: dict[str, Any], timeout_s: float = 4 * 3600) -> dict[str, Any]:
    """One measurement in a fresh process (:mod:`polykv_agents.bench.serve_worker`); its result."""
    with tempfile.TemporaryDirectory() as folder:
        request_path, result_path = Path(folder, "request.json"), Path(folder, "result.json")
        request_path.write_text(json.dumps(request))
        command = [sys.executable, "-m", "polykv_agents.bench.serve_worker", str(request_path), str(result_path)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            what = f"the serving benchmark's {request['mode']} run"
            msg = f"{what} failed (exit {done.returncode}): {done.stderr[-3000:]}"
            raise RuntimeError(msg)
        return json.loads(result_path.read_text())


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary_row(workflows: int, mode: str, measured: dict[str, Any]) -> dict[str, Any]:
    """One row: wall, aggregate tokens/s, latency and TTFT percentiles, peak RSS, and the per-workflow figures."""
    runs = measured["runs"]
    latencies = [r["latency_s"] for r in runs]
    ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
    tokens = sum(r["output_tokens"] for r in runs)
    return {
        "workflows": workflows,
        "mode": mode,
        "wall_s": measured["wall_s"],
        "output_tokens": tokens,
        "aggregate_tok_s": tokens / measured["wall_s"],
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": percentile(latencies, 0.95),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": percentile(ttfts, 0.95) if ttfts else None,
        "rss_peak_bytes": measured["rss_peak_bytes"],
        "runs": runs,
    }


def serve_texts(options: ServeOptions) -> list[str]:
    """The texts the workflows review (workflow ``i`` reads the first ``options.context`` tokens of text ``i``)."""
    from polykv_agents.eval.corpus import pydoc_documents

    return pydoc_documents(max(options.workflows), chars_per_document=max(20_000, options.context * 8))


def worker_request(options: ServeOptions, texts: list[str], mode: str) -> dict[str, Any]:
    """What a serve worker (:mod:`polykv_agents.bench.serve_worker`) needs to run ``texts``' workflows in ``mode``."""
    return {
        "mode": mode, "graph": options.graph, "graphs": str(options.graphs), "texts": texts,
        "context": options.context, "roles": options.roles, "max_tokens": options.max_tokens, "model": options.model,
    }  # fmt: skip


def run_serve(options: ServeOptions, progress: Progress = lambda _: None) -> SuiteResult:
    from polykv_agents.bench.suite import load_model_for

    texts = serve_texts(options)
    rows = []
    for workflows in options.workflows:
        for mode in options.modes:
            progress(f"{workflows} workflow(s): {MODE_LABELS[mode]}")
            rows.append(summary_row(workflows, mode, run_worker(worker_request(options, texts[:workflows], mode))))
    model, _ = load_model_for(options.model)  # after the measurements: for the run's record only
    settings = {"context": options.context, "roles": options.roles, "max_tokens": options.max_tokens}
    return SuiteResult(
        suite="serve",
        info=RunInfo.collect(model),
        settings={**settings, "graph": options.graph},
        rows=rows,
        summary=speedups(rows),
    )


def speedups(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per N: aggregate throughput at once over one after another, and p95 latency at once over one alone."""
    by = {(r["workflows"], r["mode"]): r for r in rows}
    alone = by.get((1, "at_once"), {}).get("latency_p50_s")
    summary = {}
    for (workflows, mode), row in by.items():
        if mode not in MODE_LABELS:
            continue  # another engine's row (``python -m benchmarks serve_peers``)
        sequential = by.get((workflows, "one_after_another"))
        if mode != "one_after_another" and sequential is not None:
            summary[f"{mode}_{workflows}_throughput_x"] = row["aggregate_tok_s"] / sequential["aggregate_tok_s"]
        if mode != "one_after_another" and alone:
            summary[f"{mode}_{workflows}_p95_vs_alone_x"] = row["latency_p95_s"] / alone
    return summary


def work_note(rows: list[dict[str, Any]]) -> str:
    """Whether every mode of each N decoded the same tokens, and by how much they differ where not."""
    spread = []
    for workflows in sorted({r["workflows"] for r in rows}):
        tokens = [r["output_tokens"] for r in rows if r["workflows"] == workflows]
        spread.append((max(tokens) - min(tokens)) / max(tokens))
    if not any(spread):
        return "The output tokens of each N are the same in every mode: the work is equal."
    return (
        "Every answer decodes exactly its token budget except the planner's, whose JSON ends where its content "
        "does; in bfloat16 a row rounds differently beside other rows than alone, so the plans, and the output "
        f"tokens of one N, differ by up to {max(spread):.1%} between modes. Tokens/s counts each mode's own tokens."
    )


def serve_columns(result: SuiteResult, labels: dict[str, str] = MODE_LABELS) -> list[Column]:
    """The table's columns; ``labels`` names each row's mode."""

    def versus_sequential(row: dict) -> str:
        ratio = result.summary.get(f"{row['mode']}_{row['workflows']}_throughput_x")
        return "—" if ratio is None else f"{ratio:.2f}x"

    return [
        column("workflows", "workflows"),
        Column("mode", lambda r: labels[r["mode"]]),
        Column("wall", lambda r: f"{r['wall_s']:.1f} s"),
        Column("output tokens", lambda r: f"{r['output_tokens']:,}"),
        Column("aggregate tok/s", lambda r: f"{r['aggregate_tok_s']:.1f}"),
        Column("vs one after another", versus_sequential),
        Column("latency p50 / p95", lambda r: f"{r['latency_p50_s']:.1f} / {r['latency_p95_s']:.1f} s"),
        Column(
            "TTFT p50 / p95",
            lambda r: "—" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} s",
        ),
        Column("peak RSS", lambda r: f"{r['rss_peak_bytes'] / MIB:,.0f} MiB"),
    ]


def serve_note(result: SuiteResult) -> str:
    """What each row measured, and whether the work was equal."""
    return (
        f"Each workflow reviews its own {result.settings['context']:,}-token document (pydoc_data.topics texts) with "
        f"{result.settings['roles']} roles, every answer {result.settings['max_tokens']} tokens (EOS ignored); each "
        "(N, mode) ran in a fresh process (through the server: a fresh `langgraph dev`, its own peak RSS). Latency "
        "and TTFT count from the moment all N were started; in one after another, from each workflow's own start. "
        + work_note(result.rows)
    )


def write_serve(result: SuiteResult, out_dir: Path) -> list[Path]:
    return write_suite(
        result, out_dir, title="Many workflows at once", columns=serve_columns(result), notes=[serve_note(result)]
    )


def readme_block(result: SuiteResult) -> dict[str, str]:
    """The README's table: per N, aggregate tokens/s of each mode, the gain at once, p95 latency, peak RSS."""
    by = {(r["workflows"], r["mode"]): r for r in result.rows}
    lines = [
        "| workflows | tok/s at once / one after another / through langgraph dev | at once vs one after another "
        "| p95 latency at once | peak RSS at once |",
        "|---:|---:|---:|---:|---:|",
    ]
    for workflows in sorted({w for w, _ in by}):
        rates = " / ".join(
            f"{by[workflows, m]['aggregate_tok_s']:.1f}" if (workflows, m) in by else "—" for m in MODE_LABELS
        )
        ratio = result.summary.get(f"at_once_{workflows}_throughput_x")
        at_once = by.get((workflows, "at_once"))
        gain = "—" if ratio is None else f"{ratio:.2f}x"
        p95 = "—" if at_once is None else f"{at_once['latency_p95_s']:.1f} s"
        rss = "—" if at_once is None else f"{at_once['rss_peak_bytes'] / MIB:,.0f} MiB"
        lines.append(f"| {workflows} | {rates} | {gain} | {p95} | {rss} |")
    return {"serve": "\n".join(lines)}


SUITE = TableSuite(
    "serve",
    "N review workflows over N documents started together (in this process and through langgraph dev) against "
    "the same N one after another: aggregate tokens/s, latency, TTFT, peak RSS.",
    ServeOptions,
    run_serve,
    write_serve,
    blocks=readme_block,
)
