"""``python -m benchmarks load_soak``: load and soak on the embedded model, the figures of docs/RELIABILITY.md.

Load: ``calls`` different (role, question) calls over 15 roles and one pool of a pydoc_data.topics
document, invoked alone one by one (the reference), then all at once from threads and from asyncio through
the batched scheduler; every answer must equal its reference. The first ``private_checks`` references are
also checked against ``runtime="private"`` (HF's own attention over a private decoded copy of the pool).

Soak: ``runs`` runs of graphs/role_swarm.py (3 roles + aggregator, SQLite checkpointer, a new document and
thread per run, so every run builds a new pool) in this one process, with RSS, live tensors and threads
sampled every 10 runs; growth is reported from run ``warmup_runs`` (after the warm-up) to the last. The
registry budget is ``budget_mib`` (each pool is about 2.5 MiB), so the steady state is reached in the run.
The harness is :mod:`benchmarks.studies.load` and :mod:`benchmarks.studies.soak`.
"""

from __future__ import annotations

import logging
import sqlite3
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from benchmarks.studies.workflows import LANGGRAPH_JSON, load_workflow
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for

logger = logging.getLogger(__name__)

ROLES = [
    "analyst", "skeptic", "optimist", "economist", "engineer", "lawyer", "customer", "teacher",
    "auditor", "editor", "student", "manager", "tester", "historian", "designer",
]  # fmt: skip


class LoadSoakOptions(SuiteOptions):
    calls: int = Field(default=200, ge=1)
    """Different calls in the load test."""
    load_context: int = Field(default=1024, ge=16)
    """Document tokens of the load test's pool."""
    load_tokens: int = Field(default=16, ge=1)
    """Tokens per answer in the load test."""
    private_checks: int = Field(default=30, ge=0)
    """References also checked against runtime="private"."""
    runs: int = Field(default=300, ge=1)
    """Soak runs of graphs/role_swarm.py."""
    warmup_runs: int = Field(default=100, ge=0)
    """Soak runs before growth is measured."""
    soak_context: int = Field(default=256, ge=16)
    """Document tokens per soak run."""
    soak_tokens: int = Field(default=8, ge=1)
    """Tokens per answer in the soak."""
    budget_mib: int = Field(default=64, ge=1)
    """Pool registry budget during the soak."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists graphs/role_swarm.py."""


class LoadSoakResult(BaseModel):
    run_info: RunInfo
    load: dict[str, Any]
    soak: dict[str, Any]
    total_seconds: float = 0.0


def _document(tokenizer, text: str, tokens: int, tag: str) -> str:
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:tokens]
    return f"({tag})\n" + tokenizer.decode(ids, skip_special_tokens=True)


def load_section(options: LoadSoakOptions, model, tokenizer, text: str) -> dict:
    from benchmarks.studies.load import load_cases, run_load
    from polykv_agents.chat.chat_model import ChatPolyKV
    from polykv_agents.pool.shared_pool import SharedKVPool

    document = _document(tokenizer, text, options.load_context, "load")
    pool = SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": document}])
    chat = ChatPolyKV(max_tokens=options.load_tokens).with_pool(pool)
    cases = load_cases(options.calls, ROLES)
    chat.invoke(cases[0].messages())  # warm-up
    results, answers = run_load(chat, cases)
    private = ChatPolyKV(max_tokens=options.load_tokens, runtime="private").with_pool(pool)
    checked = [str(private.invoke(case.messages()).content) for case in cases[: options.private_checks]]
    private_mismatches = sum(a != b for a, b in zip(checked, answers["sequential"], strict=False))
    return {
        "context_tokens": pool.num_tokens,
        "max_tokens": options.load_tokens,
        "roles": len(ROLES),
        "distinct_answers": len(set(answers["sequential"])),
        "results": [asdict(r) for r in results],
        "private_checked": len(checked),
        "private_mismatches": private_mismatches,
    }


def soak_section(options: LoadSoakOptions, tokenizer, text: str, progress: Progress) -> dict:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from benchmarks.studies.soak import growth, run_soak
    from polykv_agents.engine import default_engine

    role_swarm = load_workflow("role_swarm", options.graphs)
    pools = default_engine().pools  # the graph's chat models build their pools there
    pools.max_bytes = options.budget_mib * 1024 * 1024
    with tempfile.TemporaryDirectory() as tmp:
        conn = sqlite3.connect(Path(tmp) / "threads.sqlite", check_same_thread=False)
        saver = SqliteSaver(conn)  # the handle in state is plain JSON: no allow-list
        graph = role_swarm.build_graph(max_tokens=options.soak_tokens, checkpointer=saver)

        def invoke(run: int):
            state = {
                "document": _document(tokenizer, text, options.soak_context, f"soak copy {run}"),
                "question": "What is the main point?",
                "roles": ROLES[:3],
            }
            return graph.invoke(state, {"configurable": {"thread_id": f"soak-{run}"}})

        def check(run: int, result) -> None:
            if len(result["answers"]) != 3 or not result["answer"]:
                msg = f"run {run} did not complete: {result}"
                raise RuntimeError(msg)
            if run % 25 == 0:
                progress(f"soak run {run}")

        samples = run_soak(invoke, runs=options.runs, sample_every=10, check=check)
        conn.close()
    grew = growth(samples, warmup_runs=options.warmup_runs)
    return {
        "runs": options.runs,
        "context_tokens": options.soak_context,
        "max_tokens": options.soak_tokens,
        "roles": 3,
        "calls_per_run": 4,
        "registry_budget_bytes": pools.max_bytes,
        "registry_evictions": pools.evictions,
        "builds": pools.build_count,
        "seconds": samples[-1].seconds,
        "growth": asdict(grew),
        "samples": [asdict(s) for s in samples],
    }


def render_markdown(result: LoadSoakResult) -> str:
    """The tables docs/RELIABILITY.md includes."""
    info, load, soak = result.run_info, result.load, result.soak
    sequential = next(r for r in load["results"] if r["mode"] == "sequential")
    lines = [
        f"Machine: {info.sentence()}. {info.commit_sentence()}",
        "",
        f"**Load**: {load['results'][0]['calls']} different calls over {load['roles']} roles, one pool of "
        f"{load['context_tokens']} tokens, greedy, at most {load['max_tokens']} new tokens each.",
        "",
        "| how | wall time | answers different from the same call alone |",
        "|---|---:|---:|",
    ]
    for r in load["results"]:
        speed = "" if r["mode"] == "sequential" else f" ({sequential['seconds'] / r['seconds']:.1f}x faster)"
        how = {"sequential": "one by one (the reference)", "threads": "all at once, threads (`batch`)"}.get(
            r["mode"], "all at once, asyncio (`gather` of `ainvoke`)"
        )
        lines.append(f"| {how} | {r['seconds']:.1f} s{speed} | {r['mismatches']} of {r['calls']} |")
    lines += [
        "",
        f'The first {load["private_checked"]} references also equal `runtime="private"` (transformers\' own '
        f"attention over a private decoded copy): {load['private_checked'] - load['private_mismatches']} of "
        f"{load['private_checked']}. Distinct answers among the references: {load['distinct_answers']}.",
        "",
        f"**Soak**: {soak['runs']} runs of `graphs/role_swarm.py` ({soak['roles']} roles + aggregator, "
        f"{soak['max_tokens']} tokens per answer, SQLite checkpointer, a new document of {soak['context_tokens']} "
        f"tokens and a new thread per run) in one process, {soak['seconds'] / 60:.1f} min; "
        f"registry budget {soak['registry_budget_bytes'] / 2**20:.0f} MiB, {soak['builds']} pools built, "
        f"{soak['registry_evictions']} evicted.",
        "",
        "| run | RSS | live tensors | live tensor bytes | threads |",
        "|---:|---:|---:|---:|---:|",
    ]
    samples = soak["samples"]
    for sample in [s for s in samples if s["run"] % 50 == 0 or s is samples[-1]]:
        lines.append(
            f"| {sample['run']} | {sample['rss_bytes'] / 2**20:.0f} MiB | {sample['live_tensors']} | "
            f"{sample['live_tensor_bytes'] / 2**20:.1f} MiB | {sample['threads']} |"
        )
    g = soak["growth"]
    lines += [
        "",
        f"Growth from run {g['from_run']} to run {g['to_run']}: RSS {g['rss_bytes'] / 2**20:+.1f} MiB, live tensors "
        f"{g['live_tensors']:+d} ({g['live_tensor_bytes'] / 2**20:+.1f} MiB), threads {g['threads']:+d}.",
    ]
    return "\n".join(lines) + "\n"


class LoadSoakSuite(JsonSuite[LoadSoakResult]):
    name = "load_soak"
    summary = "Many calls at once equal to the same calls alone; hundreds of graph runs without growth."
    result_type = LoadSoakResult
    options = LoadSoakOptions
    reproduce = ((),)

    def run(self, options: LoadSoakOptions, progress: Progress) -> LoadSoakResult:
        from polykv_agents.eval.corpus import pydoc_documents

        started = time.perf_counter()
        model, tokenizer = load_model_for(None)
        text = pydoc_documents(1, chars_per_document=20_000)[0]
        progress(f"load: {options.calls} calls")
        load = load_section(options, model, tokenizer, text)
        progress(f"soak: {options.runs} runs")
        soak = soak_section(options, tokenizer, text, progress)
        return LoadSoakResult(
            run_info=RunInfo.collect(model), load=load, soak=soak, total_seconds=time.perf_counter() - started
        )

    def markdown(self, result: LoadSoakResult) -> str:
        return render_markdown(result)

    def rendered(self, result: LoadSoakResult) -> Rendered:
        return Rendered(blocks={"load_soak": render_markdown(result)})


SUITE = LoadSoakSuite()
