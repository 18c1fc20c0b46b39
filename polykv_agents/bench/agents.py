"""``polykv-agents bench agents``: N concurrent agents over one pool, against the alternatives.

Measured side by side in one process, on one document prefix of ``context_tokens`` tokens, every
method decoding exactly ``max_new_tokens`` per agent (EOS ignored) from the same prompts:

- ``batched, cold``: N agents at once through the runtime on a fresh engine, so the decode of the
  shared prefix from the pool is inside the timed run (what a workflow run pays);
- ``batched, warm``: the same, with the prefix already resident (a running workflow's later stages);
- ``sequential``: the same N agents one after another through the same runtime, prefix resident: the
  gain of batching alone;
- ``naive batched``: one batched forward per step over the decoded prefix copied once per agent into
  a preallocated static cache (:mod:`polykv_agents.bench.naive`): HF's prefix-cache recipe, batched.

Time to first token is the speed suite's (one definition: :mod:`polykv_agents.bench.ttft`).

KV bytes are ``nbytes`` of the tensors alive at the peak: for the runtime, the pool, its shared
decoded prefix and the batch's suffix cache; for naive batching, its static cache. Peak RSS is sampled
around each method on its own (:class:`~polykv_agents.bench.rss.PeakRss`); it includes the model's
weights, which every method holds.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field, FilePath
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.naive import naive_batched_decode
from polykv_agents.bench.output import Progress
from polykv_agents.bench.provenance import Provenance, commit_sentences
from polykv_agents.bench.rss import PeakRss
from polykv_agents.bench.suite import Rendered, SuiteOptions, document_text, load_model_for
from polykv_agents.config import CompressionConfig
from polykv_agents.engine import Engine
from polykv_agents.model.weights import WeightsChoice, weights_of
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.backend import Runtime
from polykv_agents.runtime.residency import auto_residency
from polykv_agents.runtime.shared_prefix import Residency
from polykv_agents.sampling.settings import GenerationSettings

QUESTIONS = [
    "Summarise the document in two sentences.",
    "What is the main topic?",
    "List three facts the document states.",
    "What would a critic object to?",
    "Which terms does the document define?",
]

METHODS = ("batched_cold", "batched_warm", "sequential", "naive")


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
    """The prefix residency that ran (``auto`` resolved: :mod:`~polykv_agents.runtime.residency`)."""
    weights: str = "native"
    """How the model stored its weights (``auto`` resolved); results from before the option: native."""
    defaults: bool = False
    """Whether the run asked for the package's defaults (``--runtime auto --weights auto``): the README's rows."""
    repetitions: int
    pool_nbytes: int
    kv_bytes_pooled_peak: int
    kv_bytes_naive_peak: int
    throughput_tok_s: dict[str, float]
    """Median aggregate decode tokens per second, by method (:data:`METHODS`)."""
    rss_peak_bytes: dict[str, int]
    """Largest process RSS sampled while each method ran, by method."""
    samples_tok_s: dict[str, list[float]]
    """Every timed repetition's tokens per second, by method."""
    naive_rows_identical: int
    """Agents whose naive-batched greedy tokens equal their batched ones (same work, same answers)."""
    provenance: Provenance
    """Which code ran."""


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


def answer_all(
    agents: list[PooledAgent], questions: list[str], settings: GenerationSettings, *, parallel: bool = True
) -> list[list[int]]:
    """Each agent's answer (token ids) to its question: all at once on threads (one batch), or one by one."""

    def answer(i: int) -> list[int]:
        return list(agents[i].generate_ids(questions[i], settings))

    if not parallel:
        return [answer(i) for i in range(len(agents))]
    with ThreadPoolExecutor(max_workers=len(agents)) as executor:
        return list(executor.map(answer, range(len(agents))))


def run_batched(agents: list[PooledAgent], questions: list[str], settings: GenerationSettings) -> tuple[int, float]:
    """``(tokens, seconds)`` of the agents answering at once."""
    answers, seconds = timed(lambda: answer_all(agents, questions, settings, parallel=True))
    return sum(map(len, answers)), seconds


def _measured(method: Callable[[], tuple[list[list[int]], float]]) -> tuple[list[list[int]], float, int]:
    """``(answers, tok/s, peak RSS)`` of one method, with memory freed by the previous one first."""
    gc.collect()
    with PeakRss() as rss:
        answers, seconds = method()
    return answers, sum(map(len, answers)) / seconds, rss.peak_bytes


def run_agents_bench(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    agents: int = 15,
    context_tokens: int = 2048,
    max_new_tokens: int = 32,
    repetitions: int = 3,
    runtime: Runtime = "auto",
    config: CompressionConfig | None = None,
    defaults: bool = False,
) -> AgentsBenchResult:
    """Measure the runtime, cold and warm, against sequential and naive batched decoding; medians over
    repetitions after one warm-up of each. ``runtime``: the agents' (``auto``: the residency a
    :class:`PooledAgent` picks here); ``defaults``: recorded, whether the caller asked for the package's defaults."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < context_tokens:
        msg = f"the document has {ids.numel()} tokens, fewer than --context-tokens {context_tokens}; use a longer one"
        raise ValueError(msg)
    prefix_text = tokenizer.decode(ids[:context_tokens], skip_special_tokens=True)
    pool = SharedKVPool.prefill(model, tokenizer, prefix_text, config=config)
    residency: Residency = auto_residency(model, pool, compiled_steps=False) if runtime == "auto" else runtime
    roles = role_prompts(agents)
    questions = [q for _, q in roles]
    # EOS is ignored so that every method decodes exactly max_new_tokens per agent.
    settings = GenerationSettings(max_new_tokens=max_new_tokens, ignore_eos=True)

    def agents_on(engine: Engine) -> list[PooledAgent]:
        return [
            PooledAgent(pool, model, tokenizer, system_prompt=r, runtime=residency, engine=engine) for r, _ in roles
        ]

    # The warm engine's schedulers never retire: the baselines take longer than the idle timeout.
    warm_engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
    warm = agents_on(warm_engine)
    prompts = [a.prompt_ids(q) for a, q in zip(warm, questions, strict=True)]

    def batched_cold() -> tuple[list[list[int]], float]:
        # Fresh: its scheduler decodes the prefix inside the run.
        engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
        try:
            cold = agents_on(engine)
            return timed(lambda: answer_all(cold, questions, settings, parallel=True))
        finally:
            engine.close()

    naive_kv: list[int] = []  # the static cache's bytes, from each naive run

    def naive() -> tuple[list[list[int]], float]:
        run = naive_batched_decode(model, pool, prompts, max_new_tokens)
        naive_kv.append(run.kv_bytes)
        return run.token_ids.tolist(), run.seconds

    methods: dict[str, Callable[[], tuple[list[list[int]], float]]] = {
        "batched_cold": batched_cold,
        "batched_warm": lambda: timed(lambda: answer_all(warm, questions, settings, parallel=True)),
        "sequential": lambda: timed(lambda: answer_all(warm, questions, settings, parallel=False)),
        "naive": naive,
    }
    samples: dict[str, list[float]] = {name: [] for name in methods}
    rss: dict[str, list[int]] = {name: [] for name in methods}
    answers: dict[str, list[list[int]]] = {}
    for repetition in range(repetitions + 1):  # repetition 0 is the warm-up
        for name, method in methods.items():
            answers[name], tok_s, peak = _measured(method)
            if repetition:
                samples[name].append(tok_s)
                rss[name].append(peak)
    scheduler = warm_engine.schedulers.scheduler_for(model, tokenizer, pool, residency)
    kv_pooled_peak = pool.nbytes + scheduler.prefix.peak_held_nbytes + scheduler.peak_suffix_nbytes
    warm_engine.close()
    return AgentsBenchResult(
        model_name=pool.fingerprint.name,
        dtype=pool.fingerprint.dtype,
        device=str(model.device),
        threads=torch.get_num_threads(),
        agents=agents,
        context_tokens=pool.num_tokens,
        max_new_tokens=max_new_tokens,
        runtime=residency,
        weights=weights_of(model),
        defaults=defaults,
        repetitions=repetitions,
        pool_nbytes=pool.nbytes,
        kv_bytes_pooled_peak=kv_pooled_peak,
        kv_bytes_naive_peak=max(naive_kv),
        throughput_tok_s={name: statistics.median(values) for name, values in samples.items()},
        rss_peak_bytes={name: max(values) for name, values in rss.items()},
        samples_tok_s=samples,
        naive_rows_identical=sum(a == b for a, b in zip(answers["naive"], answers["batched_warm"], strict=True)),
        provenance=Provenance.of_this_process(),
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
    runtime: Literal["auto", "decompressed", "compressed"] = "auto"
    """Prefix residency: `auto` (the agents' default: the faster one here), decompressed or compressed."""
    weights: WeightsChoice = "auto"
    """How the model stores its weights: `auto` (the loaders' default), native, int8 or int4."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f}"


def _before_todays_runtime(results: list[AgentsBenchResult]) -> list[str]:
    """The captions' warning for float32 runs from before commit recording (``[]`` for any other run)."""
    old = all(r.dtype == "float32" and r.provenance.commit_source == "inferred" for r in results)
    caveat = "made before the compute thread, int8 weights and the prefix tree; they will be re-run with them."
    return [f"**Before today's runtime:** float32 runs {caveat}", ""] * old


def results_lines(results: list[AgentsBenchResult]) -> list[str]:
    """The section of docs/RESULTS.md: conditions, the measured table, the ratios."""
    first = results[0]
    lines = [
        "## Many agents at once: batched runtime vs sequential vs naive batching",
        "",
        "Produced by `polykv-agents bench agents --context-tokens T` for T in 2048 and 4096 (the defaults: "
        "`--runtime auto --weights auto`, resolved for this machine in the table), and with "
        "`--runtime decompressed --weights native` at 4096, the defaults before both were `auto` "
        "(`polykv-agents bench plan` lists the runs).",
        "",
        f"Machine: x86_64, {first.threads} torch threads, CPU. Model: {first.model_name} "
        f"({first.dtype}; every method runs in the same dtype). {first.agents} agents, "
        f"{first.max_new_tokens} tokens each (EOS ignored, so every method decodes the same tokens from the same "
        f"prompts). Median of {first.repetitions} runs after 1 warm-up; every run's figure is in the JSON. "
        "Document: pydoc_data.topics (CPython), cut to the context length. "
        + commit_sentences([r.provenance for r in results]),
        "",
        *_before_todays_runtime(results),
        "- `batched, cold`: the runtime on a fresh engine: decoding the shared prefix from the pool is inside the "
        "timed run;",
        "- `batched, warm`: the runtime with the prefix already resident (a running workflow's later stages);",
        "- `sequential`: the same agents one after another through the same runtime, prefix resident;",
        "- `naive batched`: one batched forward per step over the decoded prefix copied once per agent into a "
        "preallocated static cache (`polykv_agents/bench/naive.py`).",
        "",
        "| context | prefix residency | weights | KV peak, runtime | KV peak, naive | tok/s batched cold / warm "
        "| tok/s sequential | tok/s naive batched | naive rows = batched "
        "| peak RSS GiB: batched / sequential / naive |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        tok, rss = r.throughput_tok_s, r.rss_peak_bytes
        lines.append(
            f"| {r.context_tokens} | {r.runtime} | {_weights_cell(r)} | {r.kv_bytes_pooled_peak / 2**20:.1f} MiB "
            f"| {r.kv_bytes_naive_peak / 2**20:.1f} MiB | {tok['batched_cold']:.1f} / {tok['batched_warm']:.1f} "
            f"| {tok['sequential']:.1f} | {tok['naive']:.1f} | {r.naive_rows_identical}/{r.agents} "
            f"| {_gib(rss['batched_warm'])} / {_gib(rss['sequential'])} / {_gib(rss['naive'])} |"
        )
    lines += [
        "",
        "| context | prefix residency | weights | KV memory: naive / runtime | batched warm / sequential "
        "| batched warm / naive | batched cold / naive |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        tok = r.throughput_tok_s
        lines.append(
            f"| {r.context_tokens} | {r.runtime} | {_weights_cell(r)} "
            f"| {r.kv_bytes_naive_peak / r.kv_bytes_pooled_peak:.1f}x "
            f"| {tok['batched_warm'] / tok['sequential']:.1f}x | {tok['batched_warm'] / tok['naive']:.1f}x "
            f"| {tok['batched_cold'] / tok['naive']:.1f}x |"
        )
    lines += [
        "",
        "Naive rows = batched: agents whose naive-batched greedy tokens are exactly their batched ones. Peak RSS is "
        "sampled around each method on its own and includes the model's weights.",
    ]
    return lines


def _weights_cell(result: AgentsBenchResult) -> str:
    """The table's weights cell: the stored form, and whether it was the default."""
    return f"{result.weights} (default)" if result.defaults else result.weights


def readme_table(results: list[AgentsBenchResult]) -> str | None:
    """The README's summary: the defaults at each context (``None``: not measured)."""
    rows = [r for r in results if r.defaults]
    if not rows:
        return None
    first = rows[0]
    lines = [
        *_before_todays_runtime(rows),
        f"{first.agents} agents, {first.max_new_tokens} tokens each (EOS ignored), over one pool; same machine, "
        f"model, dtype ({first.dtype.replace('float', 'fp')}) and prompts for every method,",
        f"median of {first.repetitions} runs after a warm-up (`polykv-agents bench agents`, full table in "
        "docs/RESULTS.md):",
        "",
        f"| context | KV peak: runtime vs {first.agents} decoded copies | tok/s: batched cold / warm "
        "| tok/s: sequential / naive batched (static cache) |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        pooled, naive = r.kv_bytes_pooled_peak / 2**20, r.kv_bytes_naive_peak / 2**20
        tok = r.throughput_tok_s
        lines.append(
            f"| {r.context_tokens:,} | {pooled:,.0f} MiB vs {naive:,.0f} MiB ({naive / pooled:.1f}x less) "
            f"| {tok['batched_cold']:.1f} / {tok['batched_warm']:.1f} | {tok['sequential']:.1f} / {tok['naive']:.1f} |"
        )
    return "\n".join(lines)


def readme_residency(results: list[AgentsBenchResult]) -> str | None:
    """The README's sentence on the defaults against a decoded prefix with native weights (the defaults until
    0.2), at the smallest context measured with both (``None``: none was)."""
    defaults = {r.context_tokens: r for r in results if r.defaults}
    before = {
        r.context_tokens: r for r in results if (r.runtime, r.weights, r.defaults) == ("decompressed", "native", False)
    }
    both = sorted(set(defaults) & set(before))
    if not both:
        return None
    now, then = defaults[both[0]], before[both[0]]
    return (
        f"At {both[0]:,} tokens the defaults here (`{now.runtime}` residency, {now.weights} weights) peak at "
        f"{now.kv_bytes_pooled_peak / 2**20:,.0f} MiB of KV ({now.kv_bytes_naive_peak / now.kv_bytes_pooled_peak:.1f}x "
        f"less than {now.agents} copies) and decode {now.throughput_tok_s['batched_warm']:.1f} tok/s warm; a decoded "
        f"prefix with native weights (the defaults before both were `auto`) peaks at "
        f"{then.kv_bytes_pooled_peak / 2**20:,.0f} MiB and decodes {then.throughput_tok_s['batched_warm']:.1f} tok/s."
    )


class AgentsSuite:
    """``polykv-agents bench agents``: one JSON per run, ``agents_<T>.json`` for the defaults, else
    ``agents_<residency>_<weights>_<T>.json``."""

    name = "agents"
    summary = "N concurrent agents over one pool, cold and warm, vs sequential agents vs naive static-cache batching."
    options = AgentsOptions
    reproduce = (
        ("--context-tokens", "2048"),
        ("--context-tokens", "4096"),
        # the defaults before both were auto
        ("--context-tokens", "4096", "--runtime", "decompressed", "--weights", "native"),
    )

    def run(self, options: AgentsOptions, progress: Progress) -> AgentsBenchResult:
        text = document_text(options.document)
        model, tokenizer = load_model_for(options.model, weights=options.weights)
        progress(f"{options.agents} agents x {options.repetitions + 1} repetitions")
        defaults = options.runtime == "auto" and options.weights == "auto"
        return run_agents_bench(
            model, tokenizer, text, agents=options.agents, context_tokens=options.context_tokens,
            max_new_tokens=options.max_new_tokens, repetitions=options.repetitions, runtime=options.runtime,
            defaults=defaults,
        )  # fmt: skip

    def write(self, result: AgentsBenchResult, out_dir: Path) -> list[Path]:
        settings = "" if result.defaults else f"{result.runtime}_{result.weights}_"
        path = out_dir / f"agents_{settings}{result.context_tokens}.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.model_dump()) + "\n", encoding="utf-8")
        return [path]

    def render(self, results_dir: Path) -> Rendered | None:
        paths = [p for p in sorted(results_dir.glob("agents_*.json")) if p.stat().st_size]
        if not paths:
            return None
        results = [AgentsBenchResult.model_validate_json(p.read_text()) for p in paths]
        results.sort(key=lambda r: (r.context_tokens, not r.defaults, r.runtime, r.weights))
        return Rendered(
            provenance=[r.provenance for r in results],
            results=results_lines(results),
            blocks={
                name: block
                for name, block in (("agents", readme_table(results)), ("agents_residency", readme_residency(results)))
                if block is not None
            },
        )


SUITE = AgentsSuite()
