"""What grammar-constrained decoding costs per token: llguidance's mask and advance, against the decode step.

    python benchmarks/grammar_overhead.py --out benchmarks/results/grammar_overhead.json

One pool of a pydoc_data.topics document on the embedded SmolLM2-135M-Instruct. For 1 and for 15
concurrent agents, the same calls decode without a grammar (EOS ignored, so every call decodes the whole
budget), under a JSON-schema grammar, and under the tool-call grammar of ``tool_choice="auto"`` (answers
that are plain text, the common case for an agent's final step); median of 3 repetitions after a
warm-up. The time inside the grammar (mask + advance) is measured by timing those two calls directly,
and the per-call cost of a grammar state (compiling the grammar into an llguidance matcher) by timing
its construction 50 times. Writes the JSON and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from polykv_agents import GenerationSettings, PooledAgent, SharedKVPool, load_model
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import column, markdown_table
from polykv_agents.eval import pydoc_documents
from polykv_agents.prompting.tool_calls import CALL_OPEN, format_tools, tool_call_grammar
from polykv_agents.sampling.grammar import TokenConstraint, json_schema_grammar
from polykv_agents.sampling.settings import token_constraint

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


def search_document(query: str) -> str:
    """Find the paragraphs of the document that match the query."""
    return query


def percent_change(old: float, new: float) -> str:
    """The change from old to new, in percent of old."""
    return f"{(new - old) / old:+.1%}"


_GRAMMAR_SECONDS: list[float] = []


def _timed(method):
    def wrapper(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            _GRAMMAR_SECONDS.append(time.perf_counter() - started)

    return wrapper


def _run(agents: list[PooledAgent], settings: GenerationSettings) -> tuple[int, float]:
    def one(agent: PooledAgent) -> int:
        return sum(1 for _ in agent.generate_ids("Summarise the document and its risks.", settings))

    started = time.perf_counter()
    with ThreadPoolExecutor(len(agents)) as executor:
        tokens = sum(executor.map(one, agents))
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/grammar_overhead.json"))
    args = parser.parse_args()

    model, tokenizer = load_model()
    ids = tokenizer(pydoc_documents(1, 20_000)[0]).input_ids[: args.context_tokens]
    pool = SharedKVPool.prefill(model, tokenizer, tokenizer.decode(ids, skip_special_tokens=True))
    TokenConstraint.mask_ = _timed(TokenConstraint.mask_)
    TokenConstraint.advance = _timed(TokenConstraint.advance)
    tools = format_tools([search_document, percent_change])
    settings = {
        "free": GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True),
        "json_schema": GenerationSettings(max_new_tokens=args.max_new_tokens, grammar=json_schema_grammar(SCHEMA)),
        "tools_auto": GenerationSettings(
            max_new_tokens=args.max_new_tokens,
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
    for count in (1, 15):
        agents = [PooledAgent(pool, model, tokenizer, system_prompt=f"You are reviewer {i}.") for i in range(count)]
        for name, setting in settings.items():
            samples = []
            for repetition in range(args.repetitions + 1):  # repetition 0 is the warm-up
                _GRAMMAR_SECONDS.clear()
                tokens, seconds = _run(agents, setting)
                if repetition:
                    samples.append((tokens / seconds, tokens, sum(_GRAMMAR_SECONDS) / max(tokens, 1)))
            tok_s = statistics.median(s[0] for s in samples)
            grammar_ms = 1000 * statistics.median(s[2] for s in samples)
            row = {
                "agents": count,
                "grammar": name,
                "tok_s": tok_s,
                "tokens": statistics.median(s[1] for s in samples),
                "grammar_ms_per_token": grammar_ms,
                # The worker thread masks every row in turn: the grammar's share of the wall time of the run.
                "grammar_share_of_wall_time": grammar_ms / 1000 * tok_s,
                "matcher_ms_per_call": matcher_ms.get(name, 0.0),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    info = RunInfo.collect(model).model_dump()
    result = {
        "run_info": info,
        "context_tokens": pool.num_tokens,
        "max_new_tokens": args.max_new_tokens,
        "repetitions": args.repetitions,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    table = markdown_table(
        rows,
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
    conditions = (
        f"Machine: {info['machine']}, {info['cpu']}, {info['torch_threads']} torch threads, torch {info['torch']}. "
        f"Model: {info['model']} ({info['dtype']}). Pool: {pool.num_tokens} tokens of pydoc_data.topics. "
        f"At most {args.max_new_tokens} new tokens per call; median of {args.repetitions} runs after 1 warm-up. "
        f"{info['date']}."
    )
    markdown = f"# Grammar overhead\n\n{conditions}\n\n{table}\n"
    args.out.with_suffix(".md").write_text(markdown, encoding="utf-8")


if __name__ == "__main__":
    main()
