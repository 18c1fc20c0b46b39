"""``polykv-agents bench speed``: time to first token, decode throughput against the number of
agents, and pool build / decompress time. Medians over ``repetitions`` after one warm-up.

- ttft: one agent's first token from the pool, against re-prefilling document + question (what a
  plain local chat model does on every call);
- throughput: N agents answering at once through the runtime, aggregate generated tokens per second
  (admission of their prompts included), at the first context length;
- build: prefill, compress (pool from that cache) and decompress (pool -> a cache in the model's
  dtype), with the targets: compress <= 10% and decompress <= 5% of the prefill time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch
from pydantic import Field, FilePath
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.agents import role_prompts, run_batched, timed, ttft_pool, ttft_reprefill
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, SuiteResult
from polykv_agents.bench.suite import SuiteOptions, TableSuite, document_text, load_model_for
from polykv_agents.config import CompressionConfig
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.sampling.settings import GenerationSettings

COMPRESS_TARGET_PCT = 10.0
DECOMPRESS_TARGET_PCT = 5.0
TTFT_QUESTION = "What is the main topic of the document?"


def _median_of(repetitions: int, measure: Callable[[], float]) -> float:
    measure()  # warm-up
    return statistics.median(measure() for _ in range(repetitions))


def _compress(model, tokenizer, cache, ids: torch.Tensor, config: CompressionConfig) -> SharedKVPool:
    return SharedKVPool.from_cache(model, tokenizer, cache, ids, config=config)


def _build_times(model, tokenizer, ids: torch.Tensor, config: CompressionConfig, repetitions: int) -> dict:
    samples: dict[str, list[float]] = {"prefill_s": [], "compress_s": [], "decompress_s": []}
    pool = None
    for repetition in range(repetitions + 1):  # the first run is the warm-up
        (cache, _), prefill_s = timed(lambda: prefill_cache(model, ids))
        pool, compress_s = timed(lambda cache=cache: _compress(model, tokenizer, cache, ids, config))
        del cache
        _, decompress_s = timed(lambda pool=pool: pool.to_cache(model))
        if repetition:
            for key, value in zip(samples, (prefill_s, compress_s, decompress_s), strict=True):
                samples[key].append(value)
    medians = {key: statistics.median(values) for key, values in samples.items()}
    assert pool is not None
    return {
        **medians,
        "pool_nbytes": pool.nbytes,
        "compress_pct_of_prefill": 100 * medians["compress_s"] / medians["prefill_s"],
        "decompress_pct_of_prefill": 100 * medians["decompress_s"] / medians["prefill_s"],
        "compress_tokens_per_s": ids.numel() / medians["compress_s"],
        "decompress_tokens_per_s": ids.numel() / medians["decompress_s"],
    }, pool


def run_speed_suite(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    contexts: Sequence[int] = (2048, 4096),
    agent_counts: Sequence[int] = (1, 3, 5, 10, 15),
    new_tokens: int = 32,
    repetitions: int = 3,
    config: CompressionConfig | None = None,
    progress: Progress = lambda _: None,
) -> SuiteResult:
    """One ``kind="build"`` and one ``kind="ttft"`` row per context, one ``kind="throughput"`` row per
    agent count (at ``contexts[0]``)."""
    config = config or CompressionConfig()
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < max(contexts):
        msg = f"the document has {ids.numel()} tokens, fewer than the largest context {max(contexts)}"
        raise ValueError(msg)
    rows = []
    pools = {}
    for context in contexts:
        progress(f"context {context}: prefill, compress, decompress")
        build, pool = _build_times(model, tokenizer, ids[:context], config, repetitions)
        pools[context] = pool
        rows.append({"kind": "build", "context_tokens": context, **build})
        progress(f"context {context}: time to first token")
        agent = PooledAgent(pool, model, tokenizer, system_prompt="You are an analyst.")
        prompt = agent.prompt_ids(TTFT_QUESTION)
        rows.append(
            {
                "kind": "ttft",
                "context_tokens": context,
                "ttft_s_pool": _median_of(repetitions, lambda agent=agent: ttft_pool(agent, TTFT_QUESTION)),
                "ttft_s_reprefill": _median_of(repetitions, lambda pool=pool, p=prompt: ttft_reprefill(model, pool, p)),
            }
        )
        rows[-1]["ttft_speedup"] = rows[-1]["ttft_s_reprefill"] / rows[-1]["ttft_s_pool"]
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    pool = pools[contexts[0]]
    for n in agent_counts:
        progress(f"context {contexts[0]}: {n} agents decoding at once")
        roles = role_prompts(n)
        agents = [PooledAgent(pool, model, tokenizer, system_prompt=r) for r, _ in roles]
        questions = [q for _, q in roles]

        def throughput(agents=agents, questions=questions) -> float:
            tokens, seconds = run_batched(agents, questions, settings)
            return tokens / seconds

        rows.append(
            {
                "kind": "throughput",
                "context_tokens": pool.num_tokens,
                "agents": n,
                "tokens_per_s": _median_of(repetitions, throughput),
            }
        )
    single = next(r["tokens_per_s"] for r in rows if r["kind"] == "throughput")
    for row in rows:
        if row["kind"] == "throughput":
            row["speedup_vs_one_agent"] = row["tokens_per_s"] / single
    builds = [r for r in rows if r["kind"] == "build"]
    return SuiteResult(
        suite="speed",
        info=RunInfo.collect(model),
        settings={
            "contexts": list(contexts),
            "agents": list(agent_counts),
            "new_tokens_per_agent": new_tokens,
            "repetitions": repetitions,
            "warmup_runs": 1,
            "config": config.label(),
        },
        rows=rows,
        summary={
            "compress_within_target": all(r["compress_pct_of_prefill"] <= COMPRESS_TARGET_PCT for r in builds),
            "decompress_within_target": all(r["decompress_pct_of_prefill"] <= DECOMPRESS_TARGET_PCT for r in builds),
        },
    )


class SpeedOptions(SuiteOptions):
    contexts: list[int] = Field(default=[2048, 4096], json_schema_extra={"flag": "--context"})
    """Context length (repeatable)."""
    agents: list[int] = Field(default=[1, 3, 5, 10, 15])
    """Agent count (repeatable)."""
    new_tokens: int = Field(default=32, ge=1)
    """Tokens each agent decodes."""
    repetitions: int = Field(default=3, ge=1)
    """Timed repetitions after one warm-up."""
    document: FilePath | None = None
    """UTF-8 text; default: pydoc_data.topics."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


def _measure(options: SpeedOptions, progress: Progress) -> SuiteResult:
    text = document_text(options.document)
    model, tokenizer = load_model_for(options.model)
    return run_speed_suite(
        model, tokenizer, text, contexts=options.contexts, agent_counts=options.agents,
        new_tokens=options.new_tokens, repetitions=options.repetitions, progress=progress,
    )  # fmt: skip


SUITE = TableSuite(
    "speed",
    "TTFT pool vs re-prefill, decode tokens/s vs agents, compress and decompress time.",
    SpeedOptions,
    _measure,
)
