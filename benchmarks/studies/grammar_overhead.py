"""``python -m benchmarks grammar_overhead``: what grammar-constrained decoding costs per token (llguidance's
mask and advance) against the decode step.

One pool of a pydoc_data.topics document on the embedded SmolLM2-135M-Instruct. For 1 and for 15
concurrent agents, the same calls decode without a grammar (EOS ignored, so every call decodes the whole
budget), under a JSON-schema grammar, and under the tool-call grammar of ``tool_choice="auto"`` (answers
that are plain text, the common case for an agent's final step); median of ``repetitions`` after a
warm-up. The time inside the grammar (mask + advance) is measured by timing those two calls directly,
and the per-call cost of a grammar state (compiling the grammar into an llguidance matcher) by timing
its construction 50 times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, Field

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, column, markdown_table
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for

SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 120},
        "risks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["summary", "risks", "priority"],
    "additionalProperties": False,
}
AGENT_COUNTS = (1, 15)


def search_document(query: str) -> str:
    """Find the paragraphs of the document that match the query."""
    return query


def percent_change(old: float, new: float) -> str:
    """The change from old to new, in percent of old."""
    return f"{(new - old) / old:+.1%}"


class GrammarOverheadOptions(SuiteOptions):
    context_tokens: int = Field(default=1024, ge=16)
    """Document tokens in the pool."""
    max_new_tokens: int = Field(default=64, ge=1)
    """At most this many tokens per call."""
    repetitions: int = Field(default=3, ge=1)
    """Timed repetitions after one warm-up."""


class GrammarOverheadResult(BaseModel):
    run_info: RunInfo
    context_tokens: int
    max_new_tokens: int
    repetitions: int
    rows: list[dict[str, Any]]


@contextmanager
def _grammar_timer() -> Iterator[list[float]]:
    """Seconds spent in every ``TokenConstraint.mask_`` and ``advance`` call while inside (methods restored)."""
    from polykv_agents.sampling.grammar import TokenConstraint

    seconds: list[float] = []

    def timed(method):
        def wrapper(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - started)

        return wrapper

    originals = TokenConstraint.mask_, TokenConstraint.advance
    TokenConstraint.mask_, TokenConstraint.advance = timed(originals[0]), timed(originals[1])
    try:
        yield seconds
    finally:
        TokenConstraint.mask_, TokenConstraint.advance = originals


def _run(agents, settings) -> tuple[int, float]:
    def one(agent) -> int:
        return sum(1 for _ in agent.generate_ids("Summarise the document and its risks.", settings))

    started = time.perf_counter()
    with ThreadPoolExecutor(len(agents)) as executor:
        tokens = sum(executor.map(one, agents))
    return tokens, time.perf_counter() - started


def run_grammar_overhead(options: GrammarOverheadOptions, progress: Progress = lambda _: None):
    """One row per (agent count, grammar): tokens/s, grammar ms per token, its share, matcher ms per call."""
    from polykv_agents.agent import PooledAgent
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.pool.shared_pool import SharedKVPool
    from polykv_agents.prompting.tool_calls import CALL_OPEN, format_tools, tool_call_grammar
    from polykv_agents.sampling.grammar import json_schema_grammar
    from polykv_agents.sampling.settings import GenerationSettings, token_constraint

    model, tokenizer = load_model_for(None)
    ids = tokenizer(pydoc_documents(1, 20_000)[0]).input_ids[: options.context_tokens]
    pool = SharedKVPool.prefill(model, tokenizer, tokenizer.decode(ids, skip_special_tokens=True))
    tools = format_tools([search_document, percent_change])
    budget = options.max_new_tokens
    settings = {
        "free": GenerationSettings(max_new_tokens=budget, ignore_eos=True),
        "json_schema": GenerationSettings(max_new_tokens=budget, grammar=json_schema_grammar(SCHEMA)),
        "tools_auto": GenerationSettings(
            max_new_tokens=budget,
            grammar=tool_call_grammar(tools, "auto", parallel=False),  # ChatPolyKV's default
            structured_opening=CALL_OPEN,
        ),
    }
    matcher_ms = {}
    for name in ("json_schema", "tools_auto"):
        timings = []
        for _ in range(50):
            started = time.perf_counter()
            token_constraint(model, tokenizer, settings[name])
            timings.append(time.perf_counter() - started)
        matcher_ms[name] = 1000 * statistics.median(timings)
    rows = []
    with _grammar_timer() as grammar_seconds:
        for count in AGENT_COUNTS:
            agents = [PooledAgent(pool, model, tokenizer, system_prompt=f"You are reviewer {i}.") for i in range(count)]
            for name, setting in settings.items():
                progress(f"{count} agents, {name}")
                samples = []
                for repetition in range(options.repetitions + 1):  # repetition 0 is the warm-up
                    grammar_seconds.clear()
                    tokens, seconds = _run(agents, setting)
                    if repetition:
                        samples.append((tokens / seconds, tokens, sum(grammar_seconds) / max(tokens, 1)))
                tok_s = statistics.median(s[0] for s in samples)
                grammar_ms = 1000 * statistics.median(s[2] for s in samples)
                rows.append(
                    {
                        "agents": count,
                        "grammar": name,
                        "tok_s": tok_s,
                        "tokens": statistics.median(s[1] for s in samples),
                        "grammar_ms_per_token": grammar_ms,
                        # The worker thread masks every row in turn: the grammar's share of the run's wall time.
                        "grammar_share_of_wall_time": grammar_ms / 1000 * tok_s,
                        "matcher_ms_per_call": matcher_ms.get(name, 0.0),
                    }
                )
    return GrammarOverheadResult(
        run_info=RunInfo.collect(model), context_tokens=pool.num_tokens, max_new_tokens=budget,
        repetitions=options.repetitions, rows=rows,
    )  # fmt: skip


def render_markdown(result: GrammarOverheadResult) -> str:
    """The table README.md links to, with its conditions."""
    table = markdown_table(
        result.rows,
        [
            column("agents", "agents"),
            column("grammar", "grammar"),
            column("tokens", "tokens", "{:.0f}"),
            column("tok/s (all agents)", "tok_s", "{:.1f}"),
            column("grammar ms/token", "grammar_ms_per_token", "{:.2f}"),
            column("grammar share of wall time", "grammar_share_of_wall_time", "{:.1%}"),
            column("grammar state per call (ms)", "matcher_ms_per_call", "{:.2f}"),
        ],
    )
    info = result.run_info
    conditions = (
        info.machine_and_model() + f" Pool: {result.context_tokens} tokens of pydoc_data.topics. "
        f"At most {result.max_new_tokens} new tokens per call; median of {result.repetitions} runs after 1 warm-up. "
        f"{info.date}."
    )
    return f"# Grammar overhead\n\n{conditions}\n\n{table}\n"


def readme_summary(result: GrammarOverheadResult) -> str:
    """The README's sentence: the ranges over the grammars, by agent count, and the per-call setup cost."""
    constrained = [r for r in result.rows if r["grammar"] != "free"]
    per_token = [r["grammar_ms_per_token"] for r in constrained]
    counts = sorted({r["agents"] for r in constrained})

    def share(count: int) -> str:
        shares = [r["grammar_share_of_wall_time"] for r in constrained if r["agents"] == count]
        return f"{min(shares):.1%}–{max(shares):.1%}".replace("%–", "–")

    matcher = {r["grammar"]: r["matcher_ms_per_call"] for r in constrained}
    return (
        f"Measured on {result.run_info.model} with a {result.context_tokens:,}-token pool: "
        f"{min(per_token):.2f}–{max(per_token):.2f} ms of masking per token, {share(counts[0])} of the wall time "
        f"for one agent and {share(counts[-1])} for {counts[-1]} batched agents, plus {matcher['json_schema']:.1f} ms "
        f"(a JSON schema) to {matcher['tools_auto']:.1f} ms (two tools) to start a call's grammar state "
        f"(`python -m benchmarks grammar_overhead`, median of {result.repetitions} after a warm-up; "
        "[table](benchmarks/results/grammar_overhead.md))."
    )


class GrammarOverheadSuite(JsonSuite[GrammarOverheadResult]):
    name = "grammar_overhead"
    summary = "What grammar-constrained decoding costs per token and per call."
    result_type = GrammarOverheadResult
    options = GrammarOverheadOptions
    reproduce = ((),)

    def run(self, options: GrammarOverheadOptions, progress: Progress) -> GrammarOverheadResult:
        return run_grammar_overhead(options, progress)

    def markdown(self, result: GrammarOverheadResult) -> str:
        return render_markdown(result)

    def rendered(self, result: GrammarOverheadResult) -> Rendered:
        return Rendered(blocks={"grammar_overhead": readme_summary(result)})


SUITE = GrammarOverheadSuite()
