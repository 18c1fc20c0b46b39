"""Probe: the pooled 15-role review with int8 weights and the compiled decode step, run alone, one run per
document length, with dynamo's recompilations logged; run it from the repository root:

    TORCH_LOGS=recompiles python benchmarks/probes/compiled_review.py

It runs the graph of ``bench peers``/``bench graph_e2e`` (pinned plan, 32-token answers, EOS ignored) on a
256-token document with 3 roles (the warm-up, in which the prefetch node compiles every batch bucket), then on
2,048 tokens and twice on 4,096 tokens of a pydoc_data.topics text, printing the wall and stage seconds.

Measured 2026-12-02 at 6fa95b4 on this project's 2-core machine (SmolLM2-135M-Instruct, bf16, int8 weights):
warm-up 145.1 s; 2,048 tokens 14.1 s (prefetch 3.5, planner 3.0, specialists 4.8, critic 1.9, summarizer 0.9);
4,096 tokens, first run, 79.8 s, with a prefetch of 63.2 s; second run 26.6 s (prefetch 10.2, planner 4.3,
specialists 8.1, critic 2.8, summarizer 1.1). The log names the cause of the first 4K run's prefetch: each
batch bucket compiled again, the guard that failed being ``2 <= T <= 4096`` on the prefix length. Inductor
sums more than 4,096 float32 elements with a cascaded summation and guards on the size to choose; the
4,096-token documents here, with the chat template, are just over it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` is not installed

from benchmarks.studies.graph_e2e import EXTRA_ROLES, _document, graphs_under_test, load_workflow, run_graph
from benchmarks.studies.workflows import LANGGRAPH_JSON
from polykv_agents.engine import load_model
from polykv_agents.eval.corpus import pydoc_documents


def main() -> None:
    workflow = load_workflow("document_review", LANGGRAPH_JSON)
    _, tokenizer = load_model(None)
    roles = [*workflow.ROLE_PROMPTS, *EXTRA_ROLES][:15]
    text = pydoc_documents(1, chars_per_document=60_000)[0]
    graph, engine = graphs_under_test(workflow, 32, "int8", True)["pooled"]
    for tokens, role_count, run in ((256, 3, -1), (2048, 15, 1), (4096, 15, 2), (4096, 15, 3)):
        result, _ = run_graph(graph, engine, _document(tokenizer, text, tokens, run), roles[:role_count])
        stages = ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in result.stage_s.items())
        print(f"{tokens} tokens: wall {result.wall_s:.1f} s ({stages})", flush=True)


if __name__ == "__main__":
    main()
