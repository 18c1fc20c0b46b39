"""``python -m benchmarks admission``: what a long prompt arriving mid-answer costs the agents already decoding.

One pool of a pydoc_data.topics document on the embedded model. N agents decode (EOS ignored); once the first
has ``join_after`` tokens, a new request with a ``prompt_tokens``-token prompt (a critic reading a long draft)
arrives. Per admission setting (chunks of ``admission_chunk_tokens``, each in the running rows' forward or in a
forward of its own, or the whole prompt in one forward), the median over repetitions of: the running agents' longest
gap between two tokens after the arrival, their median gap before it and while the newcomer was admitted, and
the newcomer's time to first token. Each run uses a scheduler of its own, on the compute thread like every
scheduler.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Any

from pydantic import BaseModel, Field, model_validator

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Column, Progress, column, markdown_table
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for
from polykv_agents.bench.ttft import time_to_first_token
from polykv_agents.runtime.scheduler import ADMISSION_CHUNK_TOKENS


class AdmissionOptions(SuiteOptions):
    context_tokens: int = Field(default=2048, ge=16)
    """Document tokens in the pool."""
    prompt_tokens: int = Field(default=600, ge=2)
    """Tokens of the prompt that arrives mid-answer."""
    running: list[int] = Field(default=[1, 15], json_schema_extra={"flag": "--running"})
    """Agents decoding when it arrives (repeatable)."""
    new_tokens: int = Field(default=48, ge=8)
    """Tokens each running agent decodes."""
    join_after: int = Field(default=8, ge=1)
    """Tokens the first running agent has when the long prompt arrives."""
    repetitions: int = Field(default=5, ge=1)
    """Timed runs per setting after one warm-up (median); the settings take turns within each."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""
    compile_decode: bool = False
    """Compiled decode steps (compiled in the warm-up run; a packed step itself runs eager)."""

    @model_validator(mode="after")
    def _arrives_mid_answer(self) -> AdmissionOptions:
        if self.join_after >= self.new_tokens:
            msg = (
                f"join_after ({self.join_after}) must be below new_tokens ({self.new_tokens}): the prompt arrives "
                "mid-answer"
            )
            raise ValueError(msg)
        return self


class AdmissionResult(BaseModel):
    run_info: RunInfo
    context_tokens: int
    prompt_tokens: int
    new_tokens: int
    repetitions: int
    compile_decode: bool = False
    rows: list[dict[str, Any]]


ADMISSION_SETTINGS = ((ADMISSION_CHUNK_TOKENS, True), (ADMISSION_CHUNK_TOKENS, False), (None, False))
"""``(admission_chunk_tokens, pack_admissions)`` of each setting measured (a whole prompt is never packed)."""


def _label(chunk: int | None, packed: bool) -> str:
    if chunk is None:
        return "whole prompt in one forward"
    where = "the running rows' forward" if packed else "a forward of its own"
    return f"chunks of {chunk} tokens, each in {where}"


def _one_run(model, tokenizer, pool, prompts, newcomer, setting, options: AdmissionOptions) -> dict:
    """One run: the running agents' token times, and the newcomer's submission and first-token times."""
    from polykv_agents.runtime.request import DecodeRequest
    from polykv_agents.runtime.scheduler import BatchScheduler
    from polykv_agents.sampling.settings import GenerationSettings

    chunk, packed = setting
    scheduler = BatchScheduler(
        model, tokenizer, pool, admission_chunk_tokens=chunk, idle_seconds=None, pack_admissions=packed,
        compile_decode=options.compile_decode,
    )  # fmt: skip
    settings = GenerationSettings(max_new_tokens=options.new_tokens, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in prompts]
    ready = threading.Event()

    def consume(index: int, stream) -> None:
        for _ in stream:
            arrivals[index].append(time.perf_counter())
            if index == 0 and len(arrivals[0]) == options.join_after:
                ready.set()

    def request(prompt, tokens):
        return DecodeRequest(
            model, tokenizer, prompt, GenerationSettings(max_new_tokens=tokens, ignore_eos=True), pool=pool
        )

    threads = [
        threading.Thread(
            target=consume, args=(i, scheduler.submit(request(p, settings.max_new_tokens), settings.max_new_tokens))
        )
        for i, p in enumerate(prompts)
    ]
    for thread in threads:
        thread.start()
    if not ready.wait(timeout=600):
        msg = "the running agents produced no tokens for 10 minutes"
        raise TimeoutError(msg)
    submitted, newcomer_ttft = time_to_first_token(lambda: scheduler.submit(request(newcomer, 1), 1))
    first_token = submitted + newcomer_ttft
    for thread in threads:
        thread.join()
    if options.compile_decode:  # a figure labelled compiled must not come from eager steps
        scheduler.compiled.require_compiled()
    scheduler.close()
    gaps = [(a, b) for times in arrivals for a, b in itertools.pairwise(times)]
    gaps_after = [b - a for a, b in gaps if b > submitted]
    gaps_before = [b - a for a, b in gaps if b <= submitted]
    gaps_during = [b - a for a, b in gaps if submitted < b <= first_token]  # none when the whole prompt went apart
    return {
        "max_gap_after_ms": 1000 * max(gaps_after),
        "median_gap_before_ms": 1000 * statistics.median(gaps_before),
        "median_gap_during_ms": 1000 * statistics.median(gaps_during) if gaps_during else None,
        "newcomer_ttft_s": newcomer_ttft,
    }


def _median(values) -> float | None:
    """The median of the values that were measured (``None`` where none was)."""
    measured = [value for value in values if value is not None]
    return statistics.median(measured) if measured else None


def run_admission(options: AdmissionOptions, progress: Progress = lambda _: None) -> AdmissionResult:
    from polykv_agents.agent import PooledAgent
    from polykv_agents.bench.agents import role_prompts
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.pool.shared_pool import SharedKVPool

    model, tokenizer = load_model_for(options.model)
    document, other = pydoc_documents(2, chars_per_document=8 * max(options.context_tokens, options.prompt_tokens))
    ids = tokenizer(document, return_tensors="pt").input_ids[0][: options.context_tokens]
    pool = SharedKVPool.prefill_tokens(model, tokenizer, ids)
    newcomer = tokenizer(other, return_tensors="pt").input_ids[0][: options.prompt_tokens]
    rows = []
    for count in options.running:
        roles = role_prompts(count)
        prompts = [PooledAgent(pool, model, tokenizer, system_prompt=r).prompt_ids(q) for r, q in roles]
        # Settings take turns within each repetition, so a drift in the machine's speed reaches all of them alike.
        runs: dict[tuple, list[dict]] = {setting: [] for setting in ADMISSION_SETTINGS}
        for repetition in range(options.repetitions + 1):
            for setting in ADMISSION_SETTINGS:
                progress(f"{count} running, {_label(*setting)}, run {repetition + 1}")
                measured = _one_run(model, tokenizer, pool, prompts, newcomer, setting, options)
                if repetition:  # the first of each setting is its warm-up
                    runs[setting].append(measured)
        for setting, measured in runs.items():
            rows.append(
                {
                    "running_agents": count,
                    "admission": _label(*setting),
                    "chunk_tokens": setting[0],
                    "packed": setting[1],
                    **{key: _median(run[key] for run in measured) for key in measured[0]},
                }
            )
    return AdmissionResult(
        run_info=RunInfo.collect(model), context_tokens=pool.num_tokens, prompt_tokens=newcomer.numel(),
        new_tokens=options.new_tokens, repetitions=options.repetitions, compile_decode=options.compile_decode,
        rows=rows,
    )  # fmt: skip


def _wait_while_admitted(row: dict) -> str:
    wait = row["median_gap_during_ms"]
    return "no token meanwhile" if wait is None else f"{wait:.0f}"


def render_markdown(result: AdmissionResult) -> str:
    table = markdown_table(
        result.rows,
        [
            column("agents decoding", "running_agents"),
            column("admission", "admission"),
            column("their step before, ms (median)", "median_gap_before_ms", "{:.0f}"),
            Column(
                "their wait while it is admitted, ms (median)",
                lambda row: (
                    "none (no token)" if row["median_gap_during_ms"] is None else f"{row['median_gap_during_ms']:.0f}"
                ),
            ),
            column("their longest wait after, ms", "max_gap_after_ms", "{:.0f}"),
            column("newcomer's first token, s", "newcomer_ttft_s", "{:.2f}"),
        ],
    )
    info = result.run_info
    conditions = (
        info.machine_and_model() + f" Pool: {result.context_tokens} tokens of pydoc_data.topics; the "
        f"newcomer's prompt: {result.prompt_tokens} tokens of another text. Running agents decode "
        f"{result.new_tokens} tokens each; {'compiled' if result.compile_decode else 'eager'} decode steps; medians "
        f"of {result.repetitions} runs after 1 warm-up. {info.date}."
    )
    return f"# A long prompt arriving mid-answer\n\n{conditions}\n\n{table}\n"


def readme_summary(result: AdmissionResult) -> str:
    def row(count: int, chunk: int | None, packed: bool) -> dict:
        return next(
            r
            for r in result.rows
            if r["running_agents"] == count and r["chunk_tokens"] == chunk and r.get("packed", False) == packed
        )

    def part(count: int) -> str:
        chunked, apart = row(count, ADMISSION_CHUNK_TOKENS, True), row(count, ADMISSION_CHUNK_TOKENS, False)
        whole = row(count, None, False)
        return (
            f"with {count} agent{'s' if count > 1 else ''} decoding, their longest wait for a token was "
            f"{chunked['max_gap_after_ms']:.0f} ms in chunks against {whole['max_gap_after_ms']:.0f} ms whole (a step "
            f"is {chunked['median_gap_before_ms']:.0f} ms), and the newcomer's first token came after "
            f"{chunked['newcomer_ttft_s']:.2f} s against {whole['newcomer_ttft_s']:.2f} s; with each chunk in the "
            f"running rows' forward their step was {_wait_while_admitted(chunked)} ms against "
            f"{_wait_while_admitted(apart)} ms with the chunk in a forward of its own (the newcomer's first "
            f"token: {chunked['newcomer_ttft_s']:.2f} s against {apart['newcomer_ttft_s']:.2f} s)"
        )

    parts = [part(count) for count in sorted({r["running_agents"] for r in result.rows})]
    return (
        f"A {result.prompt_tokens}-token prompt arriving mid-answer on {result.run_info.model} "
        f"({result.run_info.dtype}, {result.context_tokens:,}-token pool): "
        + "; ".join(parts)
        + f" (`python -m benchmarks admission`, median of {result.repetitions}; "
        "[table](../benchmarks/results/admission.md))."
    )


class AdmissionSuite(JsonSuite[AdmissionResult]):
    name = "admission"
    summary = "What a long prompt arriving mid-answer costs the running agents: chunked against whole admission."
    result_type = AdmissionResult
    options = AdmissionOptions
    reproduce = ((),)

    def run(self, options: AdmissionOptions, progress: Progress) -> AdmissionResult:
        return run_admission(options, progress)

    def markdown(self, result: AdmissionResult) -> str:
        return render_markdown(result)

    def rendered(self, result: AdmissionResult) -> Rendered:
        return Rendered(blocks={"admission": readme_summary(result)})


SUITE = AdmissionSuite()
