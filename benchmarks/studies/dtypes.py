"""``python -m benchmarks dtype``: fp32 against bf16, side by side in one run, on speed and on perplexity.

- speed (``kind="speed"``, one row per dtype): the document's prefill, and ms per decode step through the
  runtime with 1 and with N agents (pool built by a model of that dtype), medians after a warm-up;
- perplexity (``kind="ppl"``, one row per document and reading dtype): the paper's protocol (the text after a
  ``context``-token prefix), scored with the reader's own full-precision cache, with the default pool built
  by a model of the reader's dtype, and with the default pool built by the other dtype (one pool file
  serves both: its digest leaves the dtype out). Every delta is against fp32 with its own full cache;
- OpenMP teams (``kind="teams"``, :mod:`benchmarks.studies.openmp_teams`): a forward on the compute thread
  before and after a second thread ran tensor work, each in a fresh process, per dtype.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import Field

from benchmarks.studies.openmp_teams import team_rows
from polykv_agents.agent import PooledAgent
from polykv_agents.bench.agents import role_prompts
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Column, Progress, SuiteResult, column, markdown_table, write_suite
from polykv_agents.bench.stats import mean_interval, median_after_warmup
from polykv_agents.bench.step_costs import step_intervals_ms
from polykv_agents.bench.suite import SuiteOptions, TableSuite
from polykv_agents.bench.sweep import pct_interval
from polykv_agents.codecs.encoded import dtype_name
from polykv_agents.engine import Engine
from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.eval.perplexity import continuation_nll, prefix_and_continuation
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.sampling.settings import GenerationSettings

COMMAND = "python -m benchmarks dtype"

DTYPES = ("float32", "bfloat16")


def speed_row(model, tokenizer, ids: torch.Tensor, agents: int, new_tokens: int, repetitions: int) -> dict:
    """Prefill of ``ids`` and ms per decode step with 1 and ``agents`` agents over a pool of ``ids`` built by
    ``model``, through the runtime; medians after a warm-up."""

    def prefill_s() -> float:
        started = time.perf_counter()
        prefill_cache(model, ids)
        return time.perf_counter() - started

    prefill = median_after_warmup(repetitions, prefill_s)
    pool = SharedKVPool.prefill_tokens(model, tokenizer, ids)
    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    step_ms = {}
    for n in (1, agents):
        roles = role_prompts(n)
        crew = [PooledAgent(pool, model, tokenizer, system_prompt=r, engine=engine) for r, _ in roles]
        questions = [q for _, q in roles]
        step_ms[n] = median_after_warmup(
            repetitions, lambda crew=crew, questions=questions: step_intervals_ms(crew, questions, settings)
        )
    engine.close()
    return {
        "kind": "speed",
        "dtype": dtype_name(model.dtype),
        "context_tokens": ids.numel(),
        "prefill_s": prefill,
        "ms_per_step_1": step_ms[1],
        "ms_per_step_n": step_ms[agents],
        "agents": agents,
        "tok_s_1": 1000 / step_ms[1],
        "tok_s_n": 1000 * agents / step_ms[agents],
    }


def perplexity(model, cache, continuation: torch.Tensor, start: int) -> float:
    """Perplexity of ``continuation`` after ``cache`` (consumed), positions from ``start``."""
    return math.exp(continuation_nll(model, cache, continuation, start))


def _ppl_rows(models: dict, tokenizer, texts: Sequence[str], context: int, continuation_tokens: int) -> list[dict]:
    rows = []
    for document, text in enumerate(texts):
        prefix, continuation = prefix_and_continuation(models["float32"], tokenizer, text, context, continuation_tokens)
        caches = {name: prefill_cache(model, prefix)[0] for name, model in models.items()}
        pools = {
            name: SharedKVPool.from_cache(models[name], tokenizer, cache, prefix) for name, cache in caches.items()
        }
        assert len({pool.digest for pool in pools.values()}) == 1, "one pool digest for every dtype"
        reference = perplexity(models["float32"], caches["float32"], continuation, context)  # consumes that cache
        for reader, model in models.items():
            other = next(name for name in models if name != reader)
            full = reference if reader == "float32" else perplexity(model, caches[reader], continuation, context)
            same = perplexity(model, pools[reader].to_cache(model), continuation, context)
            cross = perplexity(model, pools[other].to_cache(model), continuation, context)
            rows.append(
                {
                    "kind": "ppl",
                    "document": document,
                    "reader": reader,
                    "context_tokens": context,
                    "continuation_tokens": continuation_tokens,
                    "ppl_fp32_full": reference,
                    "ppl_full": full,
                    "ppl_pool_same_dtype": same,
                    "ppl_pool_other_dtype": cross,
                    "pool_built_by_other": other,
                }
            )
    return rows


def _delta(row: dict, field: str) -> float:
    return 100 * (row[field] - row["ppl_fp32_full"]) / row["ppl_fp32_full"]


def ppl_summary(rows: Sequence[dict]) -> list[dict]:
    """Per reading dtype and cache: mean PPL delta vs fp32's full cache, with an interval over documents."""
    summary = []
    for reader in DTYPES:
        mine = [r for r in rows if r["kind"] == "ppl" and r["reader"] == reader]
        for field, cache in (
            ("ppl_full", "its own full cache"),
            ("ppl_pool_same_dtype", "default pool built in this dtype"),
            ("ppl_pool_other_dtype", "default pool built in the other dtype"),
        ):
            interval = mean_interval([_delta(r, field) for r in mine])
            summary.append(
                {
                    "reader": reader,
                    "cache": cache,
                    "delta_pct_mean": interval.mean,
                    "delta_pct_ci_low": interval.low,
                    "delta_pct_ci_high": interval.high,
                    "documents": interval.n,
                }
            )
    return summary


class DtypeOptions(SuiteOptions):
    context: int = Field(default=2048, ge=16)
    """Document tokens (speed and perplexity)."""
    agents: int = Field(default=15, ge=2)
    """Agents decoding at once for the batched step."""
    new_tokens: int = Field(default=24, ge=4)
    """Tokens each agent decodes per timed run (EOS ignored)."""
    documents: int = Field(default=5, ge=2)
    """pydoc_data.topics texts for perplexity (intervals are over documents)."""
    continuation_tokens: int = Field(default=256, ge=2)
    """Scored tokens after the prefix."""
    repetitions: int = Field(default=3, ge=1)
    """Timed repetitions after one warm-up (median)."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


def _measure(options: DtypeOptions, progress: Progress) -> SuiteResult:
    from polykv_agents.engine import load_model

    loaded = {name: load_model(options.model, dtype=name) for name in DTYPES}
    models, tokenizer = {name: model for name, (model, _) in loaded.items()}, loaded["float32"][1]
    texts = pydoc_documents(options.documents, chars_per_document=8 * (options.context + options.continuation_tokens))
    ids = tokenizer(texts[0], return_tensors="pt").input_ids[0][: options.context]
    rows = []
    for name, model in models.items():
        progress(f"{name}: prefill and decode steps")
        rows.append(speed_row(model, tokenizer, ids, options.agents, options.new_tokens, options.repetitions))
    progress(f"perplexity over {options.documents} documents, both dtypes")
    rows += _ppl_rows(models, tokenizer, texts, options.context, options.continuation_tokens)
    progress("OpenMP teams, each in a fresh process")
    rows += team_rows(
        options.model, dtypes=DTYPES, batch_sizes=(1, options.agents), repetitions=10 * options.repetitions
    )
    speed = {r["dtype"]: r for r in rows if r["kind"] == "speed"}
    return SuiteResult(
        suite="dtype",
        info=RunInfo.collect(models["float32"]),
        settings=options.model_dump(mode="json"),
        rows=rows,
        summary={
            "ppl": ppl_summary(rows),
            "bf16_speedup_prefill": speed["float32"]["prefill_s"] / speed["bfloat16"]["prefill_s"],
            "bf16_speedup_step_1": speed["float32"]["ms_per_step_1"] / speed["bfloat16"]["ms_per_step_1"],
            "bf16_speedup_step_n": speed["float32"]["ms_per_step_n"] / speed["bfloat16"]["ms_per_step_n"],
            "median_team_slowdown": statistics.median(
                r["ms_after_second_team"] / r["ms_one_team"] for r in rows if r["kind"] == "teams"
            ),
        },
    )


def ppl_phrase(summary: Sequence[dict], cache: str, **match: str) -> str:
    """``+x.xx% [low, high]`` of the summary row for ``cache`` whose fields equal ``match``."""
    return pct_interval(next(r for r in summary if r["cache"] == cache and all(r[k] == v for k, v in match.items())))


def doc_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's and docs/RUNTIME.md's sentences on dtypes and on the compute thread."""
    speed = {r["dtype"]: r for r in result.rows if r["kind"] == "speed"}
    fp32, bf16 = speed["float32"], speed["bfloat16"]
    summary, n = result.summary["ppl"], fp32["agents"]
    command = f"(`{COMMAND}`, {result.info.date}"
    source = f"{command}, {result.settings['documents']} documents; "
    own, other = "default pool built in this dtype", "default pool built in the other dtype"
    dtype = (
        f"On this machine bf16 prefilled {fp32['context_tokens']:,} tokens in {bf16['prefill_s']:.1f} s against "
        f"{fp32['prefill_s']:.1f} s in fp32, and decoded at {bf16['ms_per_step_1']:.0f} against "
        f"{fp32['ms_per_step_1']:.0f} ms per step for one agent, {bf16['ms_per_step_n']:.0f} against "
        f"{fp32['ms_per_step_n']:.0f} ms for {n}. Perplexity against fp32 with its full cache: the default pool read "
        f"in fp32 {ppl_phrase(summary, own, reader='float32')}, in bf16 from a pool built in "
        f"bf16 {ppl_phrase(summary, own, reader='bfloat16')}, in bf16 from a pool built in "
        f"fp32 {ppl_phrase(summary, other, reader='bfloat16')}; bf16 with its own full "
        f"cache {ppl_phrase(summary, 'its own full cache', reader='bfloat16')} "
        + source
        + "docs/RESULTS.md, fp32 and bf16)."
    )
    teams = [
        f"{r['dtype']}, {r['batch_size']} row{'s' if r['batch_size'] > 1 else ''}: {r['ms_one_team']:.1f} ms, then "
        f"{r['ms_after_second_team']:.1f} ms"
        for r in result.rows
        if r["kind"] == "teams"
    ]
    compute_thread = (
        "One forward over one token per row on the compute thread, before and after one forward on a second thread "
        "that then stays alive, idle, "
        f"each in a fresh process: {'; '.join(teams)} {command}; docs/RESULTS.md, fp32 and bf16)."
    )
    return {"dtype": dtype, "compute_thread": compute_thread}


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
            Column("PPL delta vs fp32 full cache, mean [95% CI]", pct_interval),
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
        "(`benchmarks/studies/openmp_teams.py`; why: `polykv_agents/model/compute_thread.py`):\n\n" + team_table,
    ]
    return write_suite(result, out_dir, title="fp32 and bf16", columns=columns, notes=notes, table_rows=speed)


SUITE = TableSuite(
    "dtype",
    "fp32 against bf16 in one run: prefill, decode steps, perplexity with the same pool; one OpenMP team.",
    DtypeOptions,
    _measure,
    write_dtype,
    command=COMMAND,
    blocks=doc_blocks,
)
