"""What grammar-constrained decoding costs per token: llguidance's mask and advance, against the decode step.

    python benchmarks/grammar_overhead.py --out benchmarks/results/grammar_overhead.json

One pool of a pydoc_data.topics document on the embedded SmolLM2-135M-Instruct. For 1 and for 15
concurrent agents, the same calls decode under a JSON-schema grammar and without one (EOS ignored
without a grammar, so both decode about as many tokens); median of 3 repetitions after a warm-up.
The time inside the grammar (mask + advance) is measured by timing those two calls directly.
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
from polykv_agents.eval import pydoc_documents
from polykv_agents.grammar import TokenConstraint, json_schema_grammar

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
    grammar = json_schema_grammar(SCHEMA)
    settings = {
        "free": GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True),
        "grammar": GenerationSettings(max_new_tokens=args.max_new_tokens, grammar=grammar),
    }
    rows = []
    for count in (1, 15):
        agents = [PooledAgent(pool, model, tokenizer, system_prompt=f"You are reviewer {i}.") for i in range(count)]
        row = {"agents": count}
        for name, setting in settings.items():
            samples = []
            for repetition in range(args.repetitions + 1):  # repetition 0 is the warm-up
                _GRAMMAR_SECONDS.clear()
                tokens, seconds = _run(agents, setting)
                if repetition:
                    samples.append((tokens / seconds, tokens, sum(_GRAMMAR_SECONDS) / max(tokens, 1)))
            row[f"tok_s_{name}"] = statistics.median(s[0] for s in samples)
            row[f"tokens_{name}"] = statistics.median(s[1] for s in samples)
            if name == "grammar":
                row["grammar_ms_per_token"] = 1000 * statistics.median(s[2] for s in samples)
        # The worker thread masks every row in turn: the grammar's share of the wall time of the run.
        row["grammar_share_of_wall_time"] = row["grammar_ms_per_token"] / 1000 * row["tok_s_grammar"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "run_info": RunInfo.collect(model).model_dump(),
        "context_tokens": pool.num_tokens,
        "max_new_tokens": args.max_new_tokens,
        "repetitions": args.repetitions,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
