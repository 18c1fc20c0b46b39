"""End to end: the 15-role document-review graph with one shared pool vs the same graph re-prefilling.

    python benchmarks/graph_e2e.py --contexts 2048 4096 --roles 15 --max-tokens 32 --repetitions 2 \
        --out benchmarks/results/graph_e2e.json

Both graphs are graphs/document_review.py with the same roles, prompts and greedy chat model; the
baseline is ``build_graph(share_pool=False)``, where every call (planner, 15 specialists, critic,
summarizer) prefills the whole document again, as a plain local chat model does. The pooled graph
builds its pool inside each run (a fresh document variant per run, so nothing is reused across
runs). One warm-up run of each on a short document first; then the median wall time per context.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graphs/ lives next to the package

from graphs.document_review import ROLE_PROMPTS, build_graph
from polykv_agents import load_model
from polykv_agents.eval import pydoc_documents

EXTRA_ROLES = ["procurement", "quality", "audit", "strategy", "data"]


def _document(tokenizer, text: str, tokens: int, run: int) -> str:
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:tokens]
    return f"(Review copy {run}.)\n" + tokenizer.decode(ids, skip_special_tokens=True)


def _run(graph, document: str, roles: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    state = graph.invoke({"document": document, "roles": roles})
    seconds = time.perf_counter() - started
    output_tokens = sum((m.usage_metadata or {}).get("output_tokens", 0) for m in state["messages"])
    return seconds, output_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--roles", type=int, default=15)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/graph_e2e.json"))
    args = parser.parse_args()

    _, tokenizer = load_model()
    roles = [*ROLE_PROMPTS, *EXTRA_ROLES][: args.roles]
    text = pydoc_documents(1, chars_per_document=60_000)[0]
    graphs = {
        "pooled": build_graph(max_tokens=args.max_tokens),
        "reprefill": build_graph(max_tokens=args.max_tokens, share_pool=False),
    }
    for graph in graphs.values():  # warm-up: load, first forward passes, scheduler thread
        _run(graph, _document(tokenizer, text, 256, run=-1), roles[:3])

    rows = []
    run = 0
    for context in args.contexts:
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in graphs}
        for _ in range(args.repetitions):
            for name, graph in graphs.items():
                run += 1
                samples[name].append(_run(graph, _document(tokenizer, text, context, run), roles))
                print(f"context={context} {name}: {samples[name][-1][0]:.1f} s", flush=True)
        row = {"context_tokens": context, "roles": len(roles), "max_tokens": args.max_tokens}
        for name, values in samples.items():
            row[f"wall_s_{name}"] = statistics.median(v[0] for v in values)
            row[f"output_tokens_{name}"] = statistics.median(v[1] for v in values)
        row["speedup"] = row["wall_s_reprefill"] / row["wall_s_pooled"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    meta = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "repetitions": args.repetitions,
        "warmup_runs": 1,
        "calls_per_run": len(roles) + 3,
        "document": "pydoc_data.topics (CPython), first 60k characters, cut to the context length",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
