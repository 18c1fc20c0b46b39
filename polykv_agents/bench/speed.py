"""``polykv-agents bench speed``: time to first token, decode throughput against the number of
agents, and pool build / decompress time. Medians over ``repetitions`` after one warm-up.

- ttft: one agent's first token from the pool, cold (a fresh engine: the prefix decode included) and
  warm (the prefix resident), against re-prefilling document + prompt (what a plain local chat model
  does on every call); the definitions are :mod:`polykv_agents.bench.ttft`'s, shared by every suite;
- throughput: N agents answering at once through the runtime with the prefix resident, aggregate
  generated tokens per second (admission of their prompts included), at the first context length;
- build: prefill, compress (pool from that cache) and decompress (pool -> a cache in the model's
  dtype), with the targets: compress <= 10% and decompress <= 5% of the prefill time;
- step costs (:mod:`polykv_agents.bench.step_costs`): ms per batched step at each agent count, and the
  cascade prefix kernel fused vs unfused.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import Field, FilePath
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.agents import role_prompts, run_batched, timed
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Column, Progress, SuiteResult, column, markdown_table, mib_column, write_suite
from polykv_agents.bench.stats import median_after_warmup
from polykv_agents.bench.step_costs import attention_kernel_rows, step_intervals_ms
from polykv_agents.bench.suite import SuiteOptions, TableSuite, document_text, load_model_for
from polykv_agents.bench.ttft import ttft_pool_cold, ttft_pool_warm, ttft_reprefill
from polykv_agents.config import CompressionConfig
from polykv_agents.engine import Engine
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.sampling.settings import GenerationSettings

COMPRESS_TARGET_PCT = 10.0
DECOMPRESS_TARGET_PCT = 5.0
TTFT_SYSTEM_PROMPT = "You are an analyst."
TTFT_QUESTION = "What is the main topic of the document?"


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
    progress(f"context {contexts[0]}: the cascade prefix kernel, fused vs unfused")
    rows = attention_kernel_rows(
        model, context=contexts[0], agents=max(agent_counts), prompt_tokens=40, repetitions=10 * repetitions
    )
    pools = {}
    # An engine whose schedulers never retire, so "warm" stays warm however long the baselines take.
    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
    for context in contexts:
        progress(f"context {context}: prefill, compress, decompress")
        build, pool = _build_times(model, tokenizer, ids[:context], config, repetitions)
        pools[context] = pool
        rows.append({"kind": "build", "context_tokens": context, **build})
        progress(f"context {context}: time to first token, cold, warm and re-prefilling")
        agent = PooledAgent(pool, model, tokenizer, system_prompt=TTFT_SYSTEM_PROMPT, engine=engine)
        prompt = agent.prompt_ids(TTFT_QUESTION)
        cold = median_after_warmup(
            repetitions, lambda pool=pool: ttft_pool_cold(pool, model, tokenizer, TTFT_SYSTEM_PROMPT, TTFT_QUESTION)
        )
        warm = median_after_warmup(repetitions, lambda agent=agent: ttft_pool_warm(agent, TTFT_QUESTION))
        reprefill = median_after_warmup(repetitions, lambda pool=pool, p=prompt: ttft_reprefill(model, pool, p))
        rows.append(
            {
                "kind": "ttft",
                "context_tokens": context,
                "prompt_tokens": prompt.numel(),
                "ttft_s_pool_cold": cold,
                "ttft_s_pool_warm": warm,
                "ttft_s_reprefill": reprefill,
                "speedup_cold": reprefill / cold,
                "speedup_warm": reprefill / warm,
            }
        )
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    pool = pools[contexts[0]]
    for n in agent_counts:
        progress(f"context {contexts[0]}: {n} agents decoding at once")
        roles = role_prompts(n)
        agents = [PooledAgent(pool, model, tokenizer, system_prompt=r, engine=engine) for r, _ in roles]
        questions = [q for _, q in roles]

        def throughput(agents=agents, questions=questions) -> float:
            tokens, seconds = run_batched(agents, questions, settings)
            return tokens / seconds

        rows.append(
            {
                "kind": "throughput",
                "context_tokens": pool.num_tokens,
                "agents": n,
                "tokens_per_s": median_after_warmup(repetitions, throughput),
                "ms_per_step": median_after_warmup(
                    repetitions,
                    lambda agents=agents, questions=questions: step_intervals_ms(agents, questions, settings),
                ),
            }
        )
    engine.close()
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


def step_costs_block(result: SuiteResult) -> str:
    """docs/RUNTIME.md's figures on what a step costs, all from this suite's rows."""
    kernel = {r["shape"]: r for r in result.rows if r["kind"] == "kernel"}
    steps = sorted((r for r in result.rows if r["kind"] == "throughput"), key=lambda r: r["agents"])
    decode, admission = kernel["decode step"], kernel["admission prefill"]
    one, most = steps[0], steps[-1]
    lines = [
        f"- The prefix part of one layer's attention over {decode['context_tokens']:,} tokens for "
        f"{decode['agents']} agents: {decode['ms_per_layer_fused']:.2f} ms with the fused kernel against "
        f"{decode['ms_per_layer_unfused']:.2f} ms matmul-softmax-matmul for a decode step "
        f"({decode['speedup']:.1f}x), {admission['ms_per_layer_fused']:.1f} ms against "
        f"{admission['ms_per_layer_unfused']:.1f} ms for an admission prefill of "
        f"{admission['query_tokens_per_agent']}-token prompts ({admission['speedup']:.1f}x).",
        f"- One step at {one['context_tokens']:,} tokens ({result.info.dtype}), on the compute thread: "
        f"{one['ms_per_step']:.0f} ms with {one['agents']} agent, {most['ms_per_step']:.0f} ms with {most['agents']} "
        f"({most['tokens_per_s']:.1f} tokens/s in all).",
    ]
    return "\n".join(lines) + f"\n\n(`polykv-agents bench speed`, {result.info.date}; docs/RESULTS.md, Speed.)"


def readme_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's sentence on build costs and time to first token, at the largest context."""
    build = max((r for r in result.rows if r["kind"] == "build"), key=lambda r: r["context_tokens"])
    ttft = max((r for r in result.rows if r["kind"] == "ttft"), key=lambda r: r["context_tokens"])
    return {
        "step_costs": step_costs_block(result),
        "speed": (
            f"Compress / decompress take {build['compress_pct_of_prefill']:.1f}% / "
            f"{build['decompress_pct_of_prefill']:.1f}% of the {build['prefill_s']:.1f} s prefill at "
            f"{build['context_tokens']:,} tokens (targets {COMPRESS_TARGET_PCT:.0f}% / {DECOMPRESS_TARGET_PCT:.0f}%). "
            f"Time to first token at {ttft['context_tokens']:,} tokens: {ttft['ttft_s_pool_cold']:.2f} s cold (the "
            f"first call of an engine decodes the prefix from the pool), {ttft['ttft_s_pool_warm']:.2f} s warm, "
            f"against {ttft['ttft_s_reprefill']:.2f} s re-prefilling the document and the same prompt "
            f"({ttft['speedup_cold']:.0f}x / {ttft['speedup_warm']:.0f}x; `polykv-agents bench speed`, median of "
            f"{result.settings['repetitions']} after a warm-up)."
        ),
    }


def throughput_vs_agents(rows: Sequence[dict]):
    from polykv_agents.bench.plots import plt

    figure, axis = plt.subplots(figsize=(6, 4))
    points = sorted(rows, key=lambda r: r["agents"])
    axis.plot([r["agents"] for r in points], [r["tokens_per_s"] for r in points], "o-")
    axis.set_xlabel("agents decoding at once")
    axis.set_ylabel("aggregate tokens/s")
    axis.set_title(f"Batched decoding over one shared {points[0]['context_tokens']}-token prefix")
    axis.grid(True, alpha=0.3)
    return figure


def write_speed(result: SuiteResult, out_dir: Path) -> list[Path]:
    """The build rows make the main table; TTFT and throughput get small tables in the notes."""
    kinds = ("build", "ttft", "throughput", "kernel")
    rows = {kind: [r for r in result.rows if r["kind"] == kind] for kind in kinds}
    columns = [
        column("context", "context_tokens"),
        column("prefill s", "prefill_s", "{:.2f}"),
        column("compress s", "compress_s", "{:.3f}"),
        column("compress % of prefill", "compress_pct_of_prefill", "{:.1f}%"),
        column("decompress s", "decompress_s", "{:.3f}"),
        column("decompress % of prefill", "decompress_pct_of_prefill", "{:.1f}%"),
        mib_column("pool MiB", "pool_nbytes", 2),
    ]
    ttft = markdown_table(
        rows["ttft"],
        [
            column("context", "context_tokens"),
            column("prompt tokens", "prompt_tokens"),
            column("TTFT pool, cold s", "ttft_s_pool_cold", "{:.3f}"),
            column("TTFT pool, warm s", "ttft_s_pool_warm", "{:.3f}"),
            column("TTFT re-prefill s", "ttft_s_reprefill", "{:.2f}"),
            Column("speed-up, cold / warm", lambda r: f"{r['speedup_cold']:.1f}x / {r['speedup_warm']:.1f}x"),
        ],
    )
    throughput = markdown_table(
        rows["throughput"],
        [
            column("agents", "agents"),
            column("tokens/s", "tokens_per_s", "{:.1f}"),
            column("vs one agent", "speedup_vs_one_agent", "{:.2f}x"),
            column("ms per step", "ms_per_step", "{:.0f}"),
        ],
    )
    kernel = markdown_table(
        rows["kernel"],
        [
            column("shape", "shape"),
            column("prefix tokens", "context_tokens"),
            column("agents", "agents"),
            column("query tokens per agent", "query_tokens_per_agent"),
            column("fused kernel ms per layer", "ms_per_layer_fused", "{:.2f}"),
            column("matmul-softmax-matmul ms per layer", "ms_per_layer_unfused", "{:.2f}"),
            column("speed-up", "speedup", "{:.1f}x"),
        ],
    )
    notes = [
        "Targets: compress <= 10% and decompress <= 5% of the prefill time.",
        "Time to first token of one agent (`polykv_agents/bench/ttft.py`). Cold: the first call of a fresh engine, "
        "so the decode of the shared prefix from the pool is inside the timed call. Warm: the prefix is already "
        "resident, as for every later call of a running workflow. Re-prefill: the document and the same prompt "
        "prefilled again into a fresh cache, as a plain local chat model does on every call:\n\n" + ttft,
        "Aggregate decode throughput, N agents at once through the runtime, prefix resident (their prompts' "
        "admission included); ms per step is the median time between an agent's consecutive tokens while all "
        "decode (one batched step each, on the compute thread):\n\n" + throughput,
        "The prefix part of cascade attention for one layer (`polykv_agents/bench/step_costs.py`): PyTorch's fused "
        "CPU attention kernel, which the runtime calls, against the matmul-softmax-matmul fallback kept for other "
        "devices:\n\n" + kernel,
    ]
    figures = {"throughput": throughput_vs_agents(rows["throughput"])}
    return write_suite(
        result, out_dir, title="Speed", columns=columns, figures=figures, notes=notes, table_rows=rows["build"]
    )


SUITE = TableSuite(
    "speed",
    "TTFT cold/warm vs re-prefill, decode tokens/s and step costs vs agents, compress and decompress time.",
    SpeedOptions,
    _measure,
    write_speed,
    blocks=readme_blocks,
)
