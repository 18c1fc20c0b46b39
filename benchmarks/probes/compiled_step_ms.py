"""Probe: ms per compiled decode step through the runtime, for 1, 2 and 15 agents, one process, one commit.

Run it on two commits to compare them (the bench suites compare settings within one run; this compares code):

    python benchmarks/probes/compiled_step_ms.py CONTEXTS WEIGHTS AGENTS   # e.g. 4096 int8 1,2,15, or 2048,4200 ...

Each count of agents decodes 48 tokens each (EOS ignored) over a pool of CONTEXT tokens of a pydoc_data.topics
document, on an ``Engine(compile_decode="inductor", max_prefix_bytes=0)``; one run warms up (and compiles),
then the median of 5 runs of the median gap between an agent's consecutive tokens is printed, with its range.
With several contexts, one process runs them in turn (a pool each) and prints how many graphs dynamo had compiled
so far after each: a document that crosses a guard compiles its buckets again.

Measured 2026-12-02 on this project's 2-core machine, SmolLM2-135M-Instruct, bf16, int8 weights, before
(589f9b8) and after (6fa95b4) the reduced attention of compiled steps (``_attend_reduced`` with the query written once):

| context | agents | before, ms/step | after, ms/step |
|---|---|---|---|
| 2048 | 1 | 17.5 (17.2-19.3) | 13.1 (12.8-13.3) |
| 2048 | 2 | 19.2 (18.9-23.6) | 15.6 (15.2-15.9) |
| 2048 | 15 | 55.3 (55.0-62.1) | 51.4 (50.2-53.6) |
| 4096 | 1 | 27.4 (25.0-30.0) | 17.5 (16.4-18.0) |
| 4096 | 2 | 33.3 (31.3-34.8) | 21.3 (20.8-27.5) |
| 4096 | 15 | 89.3 (86.9-102.3) | 79.8 (78.4-92.3) |

Without writing the query first, the reduced attention gave 28.1 ms at 4K for one agent and 45.8 ms for two.

``2048,4200 int8 1,4`` on d6fd937 (the prefix summed whole) and on a644de3 (in halves), 2026-12-02, one after the
other, on a slower day of the same machine (ms per step):

| context | agents | whole | in halves |
|---|---|---|---|
| 2048 | 1 | 27.1 (25.0-30.0) | 26.4 (23.6-33.4) |
| 2048 | 4 | 37.8 (35.0-43.4) | 38.5 (33.4-39.9) |
| 4200 | 1 | 30.6 (27.7-31.0) | 31.7 (30.7-47.5) |
| 4200 | 4 | 52.8 (46.7-56.8) | 50.8 (44.4-70.7) |

Graphs compiled after the 2,048-token pool: 3 on both; after the 4,200-token pool: 5 whole (both buckets compiled
again), 3 in halves (none).
"""

from __future__ import annotations

import statistics
import sys

import torch._dynamo.utils

from benchmarks.studies.crew import pool_and_roles, pooled_agents
from polykv_agents.bench.step_costs import step_intervals_ms
from polykv_agents.engine import Engine, load_model
from polykv_agents.sampling.settings import GenerationSettings


def main() -> None:
    contexts, weights = [int(n) for n in sys.argv[1].split(",")], sys.argv[2]
    counts = [int(n) for n in sys.argv[3].split(",")]
    model, tokenizer = load_model(None, weights=weights)
    settings = GenerationSettings(max_new_tokens=48, ignore_eos=True)
    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0, compile_decode="inductor")
    try:
        for context in contexts:
            pool, roles = pool_and_roles(model, tokenizer, context, max(counts))
            questions = [question for _, question in roles]
            for count in counts:
                crew = pooled_agents(pool, model, tokenizer, roles[:count], engine)
                step_intervals_ms(crew, questions[:count], settings)  # warm-up: compiles this bucket
                ms = [step_intervals_ms(crew, questions[:count], settings) for _ in range(5)]
                print(f"{context} tokens, {weights}, {count} agent(s): {statistics.median(ms):.1f} ms/step "
                      f"({min(ms):.1f}-{max(ms):.1f})", flush=True)  # fmt: skip
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(f"graphs compiled so far: {graphs}", flush=True)
        engine.schedulers.require_compiled()  # raises, naming why, if these steps ran eager
    finally:
        engine.close()


if __name__ == "__main__":
    main()
