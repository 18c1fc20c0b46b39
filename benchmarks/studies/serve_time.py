"""``python -m benchmarks serve_time``: where the time of ``bench serve``'s workflows goes, N at a time.

``bench serve`` measured that N review workflows over N documents started together gain little aggregate
throughput over the same N one after another (about 1.2x at N = 2 to 8 on 2 cores). This study runs the same
workloads (the same graph, documents, roles and run context, each (N, mode) in a fresh process) with the compute
thread's timeline (:mod:`benchmarks.studies.compute_timeline`) and splits each run's wall time into what that
thread did:

- **document**: prefilling each document and compressing it into its pool (and decoding a pool for a scheduler);
- **prompt steps**: steps that prefilled prompt tokens, the roles' prompts over the pool (an admission's chunks,
  with any running rows' next tokens packed in the same forward);
- **decode steps**: steps that only sampled the running rows' next tokens, every pool's rows in one forward;
- **idle**: the thread ran nothing (Python outside it: the graph's nodes, tokenizing, a shared step's gather).

Prompt tokens count every slot of an admission's chunks (``[rows, columns]``, left padding included): the work
the forward did. Sampled tokens are the tokens the step chose (one per running row, and each admitted row's
first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from benchmarks.studies.compute_timeline import STEP_KINDS
from benchmarks.studies.side_process import run_side
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import MIB, Column, Progress, SuiteResult, column, write_suite
from polykv_agents.bench.serve import MODE_LABELS, ServeOptions, serve_texts, summary_row, worker_request
from polykv_agents.bench.suite import TableSuite

SIDE = Path(__file__).with_name("serve_time_side.py")
SIDE_TIMEOUT_S = 2 * 3600
TIMED_MODES = ("at_once", "one_after_another")
"""The modes whose engine runs in the measuring process (``langgraph dev``'s runs in the server's)."""


class ServeTimeOptions(ServeOptions):
    modes: list[str] = Field(default=list(TIMED_MODES), json_schema_extra={"flag": "--mode"})
    """How to run them (repeatable): at_once, one_after_another."""

    @field_validator("modes")
    @classmethod
    def _timed_modes(cls, modes: list[str]) -> list[str]:
        other = [mode for mode in modes if mode not in TIMED_MODES]
        if other:
            msg = f"serve_time times this process's compute thread: --mode {other[0]!r} is not one of {TIMED_MODES}"
            raise ValueError(msg)
        return modes


def time_row(workflows: int, mode: str, measured: dict[str, Any]) -> dict[str, Any]:
    """``bench serve``'s row for one (N, mode), with where the compute thread's time went."""
    return {**summary_row(workflows, mode, measured), "time": measured["time"]}


def run_serve_time(options: ServeTimeOptions, progress: Progress = lambda _: None) -> SuiteResult:
    from polykv_agents.bench.suite import load_model_for

    texts = serve_texts(options)
    rows = []
    for workflows in options.workflows:
        for mode in options.modes:
            progress(f"{workflows} workflow(s): {MODE_LABELS[mode]}")
            request = worker_request(options, texts[:workflows], mode)
            measured = run_side(SIDE, request, what=f"the {mode} run", timeout_s=SIDE_TIMEOUT_S)
            rows.append(time_row(workflows, mode, measured))
    model, _ = load_model_for(options.model)  # after the measurements: for the run's record only
    settings = {"context": options.context, "roles": options.roles, "max_tokens": options.max_tokens}
    return SuiteResult(
        suite="serve_time", info=RunInfo.collect(model), settings={**settings, "graph": options.graph}, rows=rows,
        summary=shares(rows),
    )  # fmt: skip


def document_seconds(time: dict[str, Any]) -> float:
    """Seconds of the compute thread's jobs that were not scheduler steps (prefill, compression, pool decode)."""
    return sum(figures["seconds"] for kind, figures in time["kinds"].items() if kind not in STEP_KINDS)


def _kind(time: dict[str, Any], kind: str) -> dict[str, float]:
    return time["kinds"].get(kind, {"seconds": 0.0, "jobs": 0, "prompt_tokens": 0, "sampled_tokens": 0})


def prefill_seconds(time: dict[str, Any]) -> float:
    """Seconds of document work and prompt steps together: work whose cost grows with the tokens it reads, not
    shared between pools."""
    return document_seconds(time) + _kind(time, "prompt steps")["seconds"]


def _per(count: float, whole: float) -> float:
    return count / whole if whole else 0.0


def shares(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per (N, mode): the share of wall time in :func:`prefill_seconds`, and the decode steps' sampled tokens per
    second."""
    summary = {}
    for row in rows:
        time, key = row["time"], f"{row['mode']}_{row['workflows']}"
        decode = _kind(time, "decode steps")
        summary[f"{key}_prefill_share"] = prefill_seconds(time) / time["wall_s"]
        summary[f"{key}_decode_tok_s"] = _per(decode["sampled_tokens"], decode["seconds"])
    return summary


def _steps(kind: str, tokens: str) -> Column:
    """A column for one kind of step: seconds, its tokens (prompt or sampled) and their rate, tokens per step."""

    def cell(row: dict[str, Any]) -> str:
        figures = _kind(row["time"], kind)
        if not figures["jobs"]:
            return "—"
        count, seconds = figures[tokens], figures["seconds"]
        return f"{seconds:.1f} s: {count:,.0f} tok, {count / seconds:,.0f} tok/s, {count / figures['jobs']:.1f}/step"

    return Column(f"{kind} (s: {tokens.replace('_', ' ')})", cell)


def serve_time_columns() -> list[Column]:
    return [
        column("workflows", "workflows"),
        Column("mode", lambda r: MODE_LABELS[r["mode"]]),
        Column("wall", lambda r: f"{r['wall_s']:.1f} s"),
        Column("aggregate tok/s", lambda r: f"{r['aggregate_tok_s']:.1f}"),
        Column("document prefill + pool", lambda r: f"{document_seconds(r['time']):.1f} s"),
        _steps("prompt steps", "prompt_tokens"),
        _steps("decode steps", "sampled_tokens"),
        Column("compute thread idle", lambda r: f"{r['time']['idle_s']:.1f} s"),
        Column("peak RSS", lambda r: f"{r['rss_peak_bytes'] / MIB:,.0f} MiB"),
    ]


def serve_time_note(result: SuiteResult) -> str:
    settings = result.settings
    return (
        f"The workloads of `bench serve` ({settings['context']:,}-token documents, {settings['roles']} roles, "
        f"{settings['max_tokens']} tokens per answer, EOS ignored), each (N, mode) in a fresh process, one run each. "
        "Every forward runs on the one compute thread, so its jobs add up to the time it was busy; the columns split "
        "the measured wall time into them: the documents' prefill and compression, steps that prefilled the roles' "
        "prompts over the pools (prompt tokens counted as the slots of each chunk, padding included; running rows' "
        "tokens packed into the same forward are part of these steps), steps that only sampled the running rows' "
        "next tokens (tokens per step: rows in the forward, all pools' together), and the time the thread ran "
        "nothing. Columns: seconds, then tokens, tokens per second of that kind's time, tokens per step."
    )


def write_serve_time(result: SuiteResult, out_dir: Path) -> list[Path]:
    title = "Where many workflows' time goes"
    return write_suite(result, out_dir, title=title, columns=serve_time_columns(), notes=[serve_time_note(result)])


def langgraph_block(result: SuiteResult) -> dict[str, str]:
    """docs/LANGGRAPH.md's table: per N at once, the share of wall time in prefill-type work and the decode rate."""
    lines = [
        "| workflows at once | wall | document prefill + prompt steps | decode steps | decode tok/s | tokens/step |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result.rows:
        if row["mode"] != "at_once":
            continue
        time = row["time"]
        prefill, decode = prefill_seconds(time), _kind(time, "decode steps")
        rate, per_step = (_per(decode["sampled_tokens"], decode[whole]) for whole in ("seconds", "jobs"))
        lines.append(
            f"| {row['workflows']} | {row['wall_s']:.1f} s | {prefill:.1f} s ({prefill / row['wall_s']:.0%}) "
            f"| {decode['seconds']:.1f} s ({decode['seconds'] / row['wall_s']:.0%}) | {rate:,.0f} | {per_step:.1f} |"
        )
    return {"serve_time": "\n".join(lines)}


SUITE = TableSuite(
    "serve_time",
    "Where bench serve's time goes: the compute thread's time per (N, mode) in document prefill, prompt steps, "
    "decode steps and idle.",
    ServeTimeOptions,
    run_serve_time,
    write_serve_time,
    command="python -m benchmarks serve_time",
    blocks=langgraph_block,
)
