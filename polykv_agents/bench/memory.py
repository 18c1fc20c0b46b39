"""``polykv-agents bench memory``: KV bytes and process memory for 1..15 agents at several context
lengths, the runtime against N separate caches (the reference design).

Per context length, one pool is built; then per agent count N:

- ours: N agents answer at once through the runtime, with the residency the default runtime (``auto``) picks for
  the model here (:mod:`polykv_agents.runtime.residency`), and batched suffixes. KV bytes alive at the peak = pool +
  what the shared prefix holds beside it (the decoded prefix, or when kept compressed the stored layers' float
  key scales, codebook and rotation) + the batch's suffix cache, each from ``nbytes``; the process's peak RSS is
  sampled while they run;
- separate caches: N caches materialised the way the reference ``PooledAgent`` does (the pool
  decoded into a fresh cache per agent), in the model's dtype and in fp16, summed from ``nbytes``,
  with the peak RSS sampled while they exist;
- one shared fp16 prefix: what a prefix-sharing serving engine holds for the same work, the document's
  uncompressed cache once in fp16 (the pool's measured ``fp16_nbytes``) plus the same batch's suffix cache.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from pydantic import Field, FilePath
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import (
    MIB,
    Column,
    Progress,
    SuiteResult,
    column,
    markdown_table,
    mib_column,
    write_suite,
)
from polykv_agents.bench.rss import PeakRss
from polykv_agents.bench.suite import SuiteOptions, TableSuite, document_text, load_model_for
from polykv_agents.config import CompressionConfig
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.residency import auto_residency
from polykv_agents.runtime.scheduler import BatchScheduler
from polykv_agents.runtime.shared_prefix import Residency
from polykv_agents.sampling.settings import GenerationSettings


def _separate_caches_nbytes(pool: SharedKVPool, model: PreTrainedModel, n: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(KV bytes, peak RSS)`` with ``n`` decoded copies of the pool alive at once."""
    with PeakRss() as rss, torch.inference_mode():
        caches = [
            [pool.decompress_layer(i, dtype=dtype, device=model.device) for i in range(pool.num_layers)]
            for _ in range(n)
        ]
        nbytes = sum(k.nbytes + v.nbytes for layers in caches for k, v in layers)
        del caches
    return nbytes, rss.peak_bytes


def default_residency(model: PreTrainedModel, pool: SharedKVPool) -> Residency:
    """What ``runtime="auto"`` (the default) serves ``pool`` from, for ``model`` on this machine (eager steps)."""
    return auto_residency(model, pool, compiled_steps=False)


def runtime_peak(
    pool: SharedKVPool, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, n: int, new_tokens: int
) -> tuple[int, int, int, int]:
    """``(KV bytes at the peak, peak batch size, peak RSS, peak bytes of the batch's suffixes alone)`` with ``n``
    agents answering at once, over the residency the default runtime picks (:func:`default_residency`)."""
    # A fresh scheduler: its peaks are this run's alone.
    scheduler = BatchScheduler(model, tokenizer, pool, residency=default_residency(model, pool))
    agents = [PooledAgent(pool, model, tokenizer, system_prompt=f"You are analyst {i + 1} of {n}.") for i in range(n)]
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)

    def answer(agent: PooledAgent) -> int:
        prompt = agent.prompt_ids("What does the document say?")
        return len(list(scheduler.submit(DecodeRequest(model, tokenizer, prompt, settings, pool=pool), new_tokens)))

    try:
        with PeakRss() as rss, ThreadPoolExecutor(max_workers=n) as executor:
            produced = sum(executor.map(answer, agents))
        if produced != n * new_tokens:
            msg = f"expected {n * new_tokens} tokens from {n} agents, got {produced}"
            raise RuntimeError(msg)
        kv = pool.nbytes + scheduler.prefix.peak_held_nbytes + scheduler.peak_suffix_nbytes
        return kv, scheduler.peak_batch_size, rss.peak_bytes, scheduler.peak_suffix_nbytes
    finally:
        scheduler.close()


def run_memory_suite(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    contexts: Sequence[int] = (600, 2048, 4096, 7168),
    agent_counts: Sequence[int] = (1, 3, 5, 10, 15),
    new_tokens: int = 8,
    config: CompressionConfig | None = None,
    progress: Progress = lambda _: None,
) -> SuiteResult:
    """Measure every (context, agent count) pair; one row each."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < max(contexts):
        msg = f"the document has {ids.numel()} tokens, fewer than the largest context {max(contexts)}"
        raise ValueError(msg)
    rows = []
    for context in contexts:
        progress(f"context {context}: prefill and compress")
        pool = SharedKVPool.prefill(
            model, tokenizer, tokenizer.decode(ids[:context], skip_special_tokens=True), config=config
        )
        for n in agent_counts:
            progress(f"context {context}: {n} agents")
            kv_ours, batch, rss_ours, suffix = runtime_peak(pool, model, tokenizer, n, new_tokens)
            gc.collect()
            kv_separate, rss_separate = _separate_caches_nbytes(pool, model, n, model.dtype)
            kv_separate_fp16, _ = _separate_caches_nbytes(pool, model, n, torch.float16)
            gc.collect()
            rows.append(
                {
                    "context_tokens": pool.num_tokens,
                    "agents": n,
                    "residency": default_residency(model, pool),
                    "peak_batch": batch,
                    "pool_nbytes": pool.nbytes,
                    "fp16_nbytes": pool.fp16_nbytes,
                    "model_dtype_nbytes": pool.model_dtype_nbytes,
                    "kv_bytes_ours_peak": kv_ours,
                    "kv_bytes_separate_model_dtype": kv_separate,
                    "kv_bytes_separate_fp16": kv_separate_fp16,
                    "kv_bytes_shared_fp16_prefix": pool.fp16_nbytes + suffix,
                    "rss_peak_ours": rss_ours,
                    "rss_peak_separate": rss_separate,
                    "saving_vs_separate_model_dtype": kv_separate / kv_ours,
                }
            )
        del pool
        gc.collect()
    return SuiteResult(
        suite="memory",
        info=RunInfo.collect(model),
        settings={
            "contexts": list(contexts),
            "agents": list(agent_counts),
            "new_tokens_per_agent": new_tokens,
            "config": (config or CompressionConfig()).label(),
        },
        rows=rows,
    )


class MemoryOptions(SuiteOptions):
    contexts: list[int] = Field(default=[600, 2048, 4096, 7168], json_schema_extra={"flag": "--context"})
    """Context length (repeatable)."""
    agents: list[int] = Field(default=[1, 3, 5, 10, 15])
    """Agent count (repeatable)."""
    document: FilePath | None = None
    """UTF-8 text; default: pydoc_data.topics."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


def _measure(options: MemoryOptions, progress: Progress) -> SuiteResult:
    text = document_text(options.document)
    model, tokenizer = load_model_for(options.model)
    return run_memory_suite(
        model, tokenizer, text, contexts=options.contexts, agent_counts=options.agents, progress=progress
    )


_KV_KEYS = ("kv_bytes_ours_peak", "kv_bytes_shared_fp16_prefix", "kv_bytes_separate_model_dtype")


def readme_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's memory table: per context, the pool against one fp16 cache, and the KV alive with the most
    agents at once against a cache per agent."""
    agents = max(row["agents"] for row in result.rows)
    columns = [
        column("context tokens", "context_tokens", "{:,}"),
        Column(f"pool ({result.settings['config']})", lambda r: f"{r['pool_nbytes'] / MIB:,.2f} MiB"),
        Column("x vs one fp16 cache", lambda r: f"{r['fp16_nbytes'] / r['pool_nbytes']:.2f}x"),
        Column(
            f"KV with {agents} agents at once: ours vs one shared fp16 prefix vs a cache each",
            lambda r: " vs ".join(f"{r[key] / MIB:,.1f}" for key in _KV_KEYS) + " MiB",
        ),
    ]
    return {"memory": markdown_table([row for row in result.rows if row["agents"] == agents], columns)}


def memory_vs_agents(rows: Sequence[dict]):
    """KV MiB against agents: one colour per context, the runtime solid, separate caches dashed."""
    from polykv_agents.bench.plots import plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for index, context in enumerate(sorted({r["context_tokens"] for r in rows})):
        points = sorted((r for r in rows if r["context_tokens"] == context), key=lambda r: r["agents"])
        agents = [r["agents"] for r in points]
        colour = f"C{index}"
        axis.plot(agents, [r["kv_bytes_ours_peak"] / MIB for r in points], "o-", color=colour,
                  label=f"{context} tokens: one pool + shared prefix")  # fmt: skip
        axis.plot(agents, [r["kv_bytes_separate_model_dtype"] / MIB for r in points], "s--", color=colour,
                  alpha=0.6, label=f"{context} tokens: separate caches")  # fmt: skip
    axis.set_yscale("log")
    axis.set_xlabel("agents reading the document at once")
    axis.set_ylabel("peak KV memory (MiB, log scale)")
    axis.set_title("KV memory: one shared pool vs a cache per agent")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    return figure


def _rss_pair(row: dict) -> str:
    return f"{row['rss_peak_ours'] / 2**30:.2f} / {row['rss_peak_separate'] / 2**30:.2f}"


def _residency_note(residencies: set[str]) -> str:
    """What the shared prefix held beside the pool in these rows (the default runtime's residency)."""
    if residencies == {"compressed"}:
        return (
            "The default runtime kept only the pool (`compressed`: the native kernel reads it as stored, through AMX "
            "tiles here), so the document's KV is the pool plus the stored layers' float key scales, one codebook "
            "and one rotation: less than one shared fp16 prefix."
        )
    return (
        "Ours holds more KV than one shared fp16 prefix: here the default runtime kept the decoded prefix (model "
        "dtype) beside the pool (no AMX tiles, or not bfloat16), so the pool's bytes come on top, not instead."
    )


def write_memory(result: SuiteResult, out_dir: Path) -> list[Path]:
    columns = [
        column("context", "context_tokens"),
        column("agents", "agents"),
        mib_column("pool MiB", "pool_nbytes", 2),
        mib_column("one fp16 cache MiB", "fp16_nbytes"),
        mib_column("peak KV, ours MiB", "kv_bytes_ours_peak"),
        mib_column("one shared fp16 prefix MiB", "kv_bytes_shared_fp16_prefix"),
        mib_column("N separate caches MiB", "kv_bytes_separate_model_dtype"),
        mib_column("N separate fp16 caches MiB", "kv_bytes_separate_fp16"),
        column("saving", "saving_vs_separate_model_dtype", "{:.1f}x"),
        Column("peak RSS GiB, ours / separate", _rss_pair),
    ]
    notes = [
        "Peak KV, ours: pool + what the shared prefix holds beside it + the batch's suffix cache while N agents "
        "decode at once. Separate caches: N decoded copies of the pool alive at once, as the reference design makes "
        "one per agent call (model dtype, and fp16 for comparison with the paper). One shared fp16 prefix: what a "
        "prefix-sharing serving engine holds for the same work, the document's cache once in fp16 plus the same "
        "batch's suffix cache. All bytes are `nbytes` of tensors that existed; RSS is the whole process, sampled "
        "every 5 ms. " + _residency_note({row.get("residency", "decompressed") for row in result.rows})
    ]
    figures = {"vs_agents": memory_vs_agents(result.rows)}
    return write_suite(result, out_dir, title="Memory", columns=columns, figures=figures, notes=notes)


SUITE = TableSuite(
    "memory",
    "KV bytes and peak RSS for 1..15 agents at 600..7K tokens, ours vs a cache per agent.",
    MemoryOptions,
    _measure,
    write_memory,
    blocks=readme_blocks,
)
