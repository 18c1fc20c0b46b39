"""``polykv-agents bench agents``: N concurrent agents over one pool, against the alternatives.

Measured side by side in one process, on one document prefix of ``context_tokens`` tokens:

- ``batched``: N agents at once through the runtime (one shared prefix, cascade attention, one
  batched forward per step);
- ``sequential``: the same N agents one after another, each alone (single-sequence decoding);
- ``naive_batched``: one batched forward per step over the prefix copied N times (HF's prefix-cache
  recipe, batched), the baseline that stalls on CPU;
- TTFT of one agent from the pool, against re-prefilling document + question (what a plain local
  chat model does on every call).

KV bytes are ``nbytes`` of the tensors alive at the peak: for the runtime, the pool, its shared
decoded prefix and the batch's suffix cache; for naive batching, its N-row cache.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field, FilePath
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.output import Progress
from polykv_agents.bench.suite import Rendered, SuiteOptions, document_text, load_model_for
from polykv_agents.config import CompressionConfig
from polykv_agents.engine import Engine
from polykv_agents.model.compat import cache_keyword, forward_with_cache, layer_key_values, new_dynamic_cache
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.scheduler import BatchScheduler
from polykv_agents.runtime.shared_prefix import Residency
from polykv_agents.sampling.settings import GenerationSettings

QUESTIONS = [
    "Summarise the document in two sentences.",
    "What is the main topic?",
    "List three facts the document states.",
    "What would a critic object to?",
    "Which terms does the document define?",
]


class AgentsBenchResult(BaseModel):
    """One run of the agents benchmark; every figure is measured."""

    model_name: str
    dtype: str
    device: str
    threads: int
    agents: int
    context_tokens: int
    max_new_tokens: int
    runtime: str
    repetitions: int
    pool_nbytes: int
    kv_bytes_pooled_peak: int
    kv_bytes_naive_peak: int
    throughput_tok_s_batched: float
    throughput_tok_s_sequential: float
    throughput_tok_s_naive_batched: float
    ttft_s_pool: float
    ttft_s_reprefill: float
    rss_peak_bytes: int


def role_prompts(n: int) -> list[tuple[str, str]]:
    """Role prompts and questions of varied lengths."""
    return [
        (f"You are specialist {i + 1} of {n}. " + "Be precise. " * (i % 4), QUESTIONS[i % len(QUESTIONS)])
        for i in range(n)
    ]


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def run_batched(agents: list[PooledAgent], questions: list[str], settings: GenerationSettings) -> tuple[int, float]:
    def answer(i: int) -> int:
        return len(list(agents[i].generate_ids(questions[i], settings)))

    with ThreadPoolExecutor(max_workers=len(agents)) as executor:
        counts, seconds = timed(lambda: list(executor.map(answer, range(len(agents)))))
    return sum(counts), seconds


def _run_sequential(agents: list[PooledAgent], questions: list[str], settings: GenerationSettings) -> tuple[int, float]:
    counts, seconds = timed(
        lambda: [len(list(a.generate_ids(q, settings))) for a, q in zip(agents, questions, strict=True)]
    )
    return sum(counts), seconds


@torch.inference_mode()
def _run_naive_batched(
    model: PreTrainedModel, pool: SharedKVPool, prompts: list[torch.Tensor], max_new_tokens: int
) -> tuple[int, float, int]:
    """Greedy batched decoding over the decoded prefix copied once per row (left-padded prompts)."""
    started = time.perf_counter()
    rows, start = len(prompts), pool.num_tokens
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, start + width, dtype=torch.long)
    mask[:, :start] = 1
    for r, prompt in enumerate(prompts):
        ids[r, width - prompt.numel() :] = prompt
        mask[r, start + width - prompt.numel() :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:]  # each row's own positions
    cache = new_dynamic_cache(model)
    for layer_idx in range(pool.num_layers):
        keys, values = pool.decompress_layer(layer_idx, dtype=model.dtype, device=model.device)
        cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer_idx)  # N copies
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1, **{cache_keyword(model): cache}
    ).logits
    tokens = 0
    for _ in range(max_new_tokens):
        next_ids = logits[:, -1].argmax(-1, keepdim=True)  # [N, 1]
        tokens += rows
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=-1)
        positions = positions[:, -1:] + 1
        logits = model(
            input_ids=next_ids, attention_mask=mask, position_ids=positions, **{cache_keyword(model): cache}
        ).logits
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in layer_key_values(cache))
    return tokens, time.perf_counter() - started, kv_bytes


def ttft_pool(agent: PooledAgent, question: str) -> float:
    settings = GenerationSettings(max_new_tokens=1)
    return timed(lambda: list(agent.generate_ids(question, settings)))[1]


@torch.inference_mode()
def ttft_reprefill(model: PreTrainedModel, pool: SharedKVPool, prompt: torch.Tensor) -> float:
    """A plain local chat model: prefill document + question, then pick the first token."""
    ids = torch.cat([pool.token_ids, prompt]).unsqueeze(0)

    def first_token() -> int:
        logits = forward_with_cache(model, ids, new_dynamic_cache(model), start_position=0, logits_to_keep=1)
        return int(logits[0, -1].argmax())

    return timed(first_token)[1]


def run_agents_bench(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    agents: int = 15,
    context_tokens: int = 2048,
    max_new_tokens: int = 32,
    repetitions: int = 3,
    runtime: Residency = "decompressed",
    config: CompressionConfig | None = None,
) -> AgentsBenchResult:
    """Measure the runtime against sequential and naive batched decoding; medians over repetitions
    after one warm-up of each."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < context_tokens:
        msg = f"the document has {ids.numel()} tokens, fewer than --context-tokens {context_tokens}; use a longer one"
        raise ValueError(msg)
    prefix_text = tokenizer.decode(ids[:context_tokens], skip_special_tokens=True)
    pool = SharedKVPool.prefill(model, tokenizer, prefix_text, config=config)
    roles = role_prompts(agents)
    # An engine of its own, whose schedulers never retire: the baselines take longer than the idle timeout.
    engine = Engine(scheduler_idle_seconds=None)
    pooled = [PooledAgent(pool, model, tokenizer, system_prompt=r, runtime=runtime, engine=engine) for r, _ in roles]
    private = [PooledAgent(pool, model, tokenizer, system_prompt=r, runtime="private") for r, _ in roles]
    questions = [q for _, q in roles]
    prompts = [a.prompt_ids(q) for a, q in zip(pooled, questions, strict=True)]
    # EOS is ignored so that every method decodes exactly max_new_tokens per agent.
    settings = GenerationSettings(max_new_tokens=max_new_tokens, ignore_eos=True)

    samples: dict[str, list[float]] = {"batched": [], "sequential": [], "naive": [], "ttft_pool": [], "ttft_re": []}
    naive_kv = 0
    scheduler: BatchScheduler = engine.schedulers.scheduler_for(model, tokenizer, pool, runtime)
    for repetition in range(repetitions + 1):  # repetition 0 is the warm-up
        tokens, seconds = run_batched(pooled, questions, settings)
        batched = tokens / seconds
        tokens, seconds = _run_sequential(private, questions, settings)
        sequential = tokens / seconds
        tokens, seconds, naive_kv = _run_naive_batched(model, pool, prompts, max_new_tokens)
        naive = tokens / seconds
        first_pool = ttft_pool(pooled[0], questions[0])
        first_reprefill = ttft_reprefill(model, pool, prompts[0])
        if repetition:
            for key, value in zip(samples, (batched, sequential, naive, first_pool, first_reprefill), strict=True):
                samples[key].append(value)
    median = {key: statistics.median(values) for key, values in samples.items()}
    return AgentsBenchResult(
        model_name=pool.fingerprint.name,
        dtype=pool.fingerprint.dtype,
        device=str(model.device),
        threads=torch.get_num_threads(),
        agents=agents,
        context_tokens=pool.num_tokens,
        max_new_tokens=max_new_tokens,
        runtime=runtime,
        repetitions=repetitions,
        pool_nbytes=pool.nbytes,
        kv_bytes_pooled_peak=pool.nbytes + scheduler.prefix.peak_decoded_nbytes + scheduler.peak_suffix_nbytes,
        kv_bytes_naive_peak=naive_kv,
        throughput_tok_s_batched=median["batched"],
        throughput_tok_s_sequential=median["sequential"],
        throughput_tok_s_naive_batched=median["naive"],
        ttft_s_pool=median["ttft_pool"],
        ttft_s_reprefill=median["ttft_re"],
        rss_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


class AgentsOptions(SuiteOptions):
    document: FilePath | None = None
    """UTF-8 text (the shared prefix); default: the first 60k characters of pydoc_data.topics."""
    agents: int = Field(default=15, ge=1, le=64)
    """Concurrent agents."""
    context_tokens: int = Field(default=2048, ge=16)
    """Document tokens in the pool."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Tokens each agent decodes."""
    repetitions: int = Field(default=3, ge=1)
    """Timed repetitions after one warm-up."""
    runtime: Literal["decompressed", "compressed"] = "decompressed"
    """Prefix residency: decompressed or compressed."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


# How the committed agents_*.json were made; docs/RESULTS.md says so above the table.
PRODUCED_BY = (
    "Produced by `polykv-agents bench agents --document DOC --agents 15 --context-tokens T --max-new-tokens 32 "
    "--repetitions 3 --json` for T in 2048 and 4096, and with `--runtime compressed` at 2048 (DOC: the first "
    "60k characters of pydoc_data.topics)."
)


def results_lines(results: list[AgentsBenchResult]) -> list[str]:
    """The section of docs/RESULTS.md: conditions, the measured table, the ratios."""
    first = results[0]
    lines = [
        PRODUCED_BY,
        "",
        "## Many agents at once: batched runtime vs sequential vs naive batching",
        "",
        f"Machine: x86_64, {first.threads} torch threads, CPU. Model: {first.model_name} "
        f"({first.dtype}; every baseline runs in the same dtype). {first.agents} agents, "
        f"{first.max_new_tokens} tokens each (EOS ignored, so every method decodes the same tokens). "
        f"Median of {first.repetitions} runs after 1 warm-up. "
        "Document: pydoc_data.topics (CPython), cut to the context length.",
        "",
        "- `batched`: the runtime (one shared decoded prefix, cascade attention, one batched forward per step);",
        "- `sequential`: the same agents one after another, each alone over a private decoded copy of the pool;",
        "- `naive batched`: one batched forward per step over the decoded prefix copied once per agent;",
        "- TTFT: one agent's first token from the pool, vs prefilling document + question (a plain chat model).",
        "",
        "| context | prefix residency | KV peak, runtime | KV peak, naive | tok/s batched | tok/s sequential "
        "| tok/s naive batched | TTFT pool | TTFT re-prefill | process peak RSS |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.context_tokens} | {r.runtime} | {r.kv_bytes_pooled_peak / 2**20:.1f} MiB "
            f"| {r.kv_bytes_naive_peak / 2**20:.1f} MiB "
            f"| {r.throughput_tok_s_batched:.1f} | {r.throughput_tok_s_sequential:.1f} "
            f"| {r.throughput_tok_s_naive_batched:.1f} | {r.ttft_s_pool:.3f} s | {r.ttft_s_reprefill:.2f} s "
            f"| {r.rss_peak_bytes / 2**30:.2f} GiB |"
        )
    lines += [
        "",
        "| context | prefix residency | KV memory: naive / runtime | batched / sequential | batched / naive "
        "| TTFT speed-up |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.context_tokens} | {r.runtime} | {r.kv_bytes_naive_peak / r.kv_bytes_pooled_peak:.1f}x "
            f"| {r.throughput_tok_s_batched / r.throughput_tok_s_sequential:.1f}x "
            f"| {r.throughput_tok_s_batched / r.throughput_tok_s_naive_batched:.1f}x "
            f"| {r.ttft_s_reprefill / r.ttft_s_pool:.0f}x |"
        )
    return lines


def readme_table(results: list[AgentsBenchResult]) -> str | None:
    """The README's summary: the default residency at each context (``None``: not measured)."""
    rows = [r for r in results if r.runtime == "decompressed"]
    if not rows:
        return None
    first = rows[0]
    lines = [
        f"{first.agents} agents, {first.max_new_tokens} tokens each, over one pool; same machine, model and dtype "
        f"({first.dtype.replace('float', 'fp')}) for every method,",
        f"median of {first.repetitions} runs after a warm-up (`polykv-agents bench agents`, full table in "
        "docs/RESULTS.md):",
        "",
        f"| context | KV peak: runtime vs {first.agents} decoded copies | tok/s: batched / sequential / naive batched "
        "| TTFT: pool vs re-prefill |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        pooled, naive = r.kv_bytes_pooled_peak / 2**20, r.kv_bytes_naive_peak / 2**20
        lines.append(
            f"| {r.context_tokens:,} | {pooled:,.0f} MiB vs {naive:,.0f} MiB ({naive / pooled:.1f}x less) "
            f"| {r.throughput_tok_s_batched:.1f} / {r.throughput_tok_s_sequential:.1f} / "
            f"{r.throughput_tok_s_naive_batched:.1f} | {r.ttft_s_pool:.2f} s vs {r.ttft_s_reprefill:.2f} s "
            f"({r.ttft_s_reprefill / r.ttft_s_pool:.0f}x) |"
        )
    return "\n".join(lines)


def readme_residency(results: list[AgentsBenchResult]) -> str | None:
    """The README's sentence on the two prefix residencies, at the smallest context measured with both
    (``None``: none was)."""
    by_key = {(r.context_tokens, r.runtime): r for r in results}
    both = [c for c, runtime in by_key if runtime == "compressed" and (c, "decompressed") in by_key]
    if not both:
        return None
    context = min(both)
    default, compressed = by_key[(context, "decompressed")], by_key[(context, "compressed")]
    return (
        f"Prefix residency at {context:,} tokens: `decompressed` (default) peaks at "
        f"{default.kv_bytes_pooled_peak / 2**20:,.0f} MiB of KV and decodes {default.throughput_tok_s_batched:.1f} "
        f"tok/s; `compressed` peaks at {compressed.kv_bytes_pooled_peak / 2**20:,.0f} MiB "
        f"({compressed.kv_bytes_naive_peak / compressed.kv_bytes_pooled_peak:.1f}x less than {compressed.agents} "
        f"copies) and decodes {compressed.throughput_tok_s_batched:.1f} tok/s."
    )


class AgentsSuite:
    """``polykv-agents bench agents``: one JSON per (context, residency), ``agents_[compressed_]<T>.json``."""

    name = "agents"
    summary = "N concurrent agents over one pool vs sequential agents vs naive batching over a copied prefix."
    options = AgentsOptions
    reproduce = (
        ("--context-tokens", "2048"),
        ("--context-tokens", "4096"),
        ("--context-tokens", "2048", "--runtime", "compressed"),
    )

    def run(self, options: AgentsOptions, progress: Progress) -> AgentsBenchResult:
        text = document_text(options.document)
        model, tokenizer = load_model_for(options.model)
        progress(f"{options.agents} agents x {options.repetitions + 1} repetitions")
        return run_agents_bench(
            model, tokenizer, text, agents=options.agents, context_tokens=options.context_tokens,
            max_new_tokens=options.max_new_tokens, repetitions=options.repetitions, runtime=options.runtime,
        )  # fmt: skip

    def write(self, result: AgentsBenchResult, out_dir: Path) -> list[Path]:
        residency = "" if result.runtime == "decompressed" else f"{result.runtime}_"
        path = out_dir / f"agents_{residency}{result.context_tokens}.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.model_dump()) + "\n", encoding="utf-8")
        return [path]

    def render(self, results_dir: Path) -> Rendered | None:
        paths = [p for p in sorted(results_dir.glob("agents_*.json")) if p.stat().st_size]
        if not paths:
            return None
        results = [AgentsBenchResult.model_validate_json(p.read_text()) for p in paths]
        results.sort(key=lambda r: (r.context_tokens, r.runtime))
        return Rendered(
            results=results_lines(results),
            blocks={
                name: block
                for name, block in (("agents", readme_table(results)), ("agents_residency", readme_residency(results)))
                if block is not None
            },
        )


SUITE = AgentsSuite()
