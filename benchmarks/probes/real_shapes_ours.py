"""Our half of ``python -m benchmarks.probes.real_shapes_review``, in a fresh process of its own:

    python benchmarks/probes/real_shapes_ours.py REQUEST.json RESULT.json

The peers' own side (:mod:`benchmarks.studies.ours_side`) with one difference: the model is a folder of
:mod:`benchmarks.real_shapes` (a published configuration with random weights), not the embedded SmolLM2. Per
document: the 15-role review graph once, its calls recorded token for token for llama.cpp to replay, then the
peers' probe (:func:`benchmarks.studies.ours_side.probe`: TTFT, 1- and 15-agent decode, prefill, KV bytes).

Request: ``{"model", "weights", "graphs", "max_tokens", "roles", "context", "texts": [str]}``; ``model`` is the
folder. Result: as :func:`benchmarks.studies.ours_side.measure`'s.

Why not a ``model`` field in ``ours_side``'s request: that file is one of the committed peers results' sources,
and a byte changed there marks them stale (:mod:`benchmarks.staleness`). The two merge when peers runs again.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.studies.side_process import peak_rss_bytes, rss_bytes


def pooled_graph(workflow, model: str, max_tokens: int, weights: str):
    """The review graph with one pool over ``model`` and its recording engine, as the peers build it
    (:func:`benchmarks.studies.graph_e2e.graphs_under_test`'s pooled method, the plan pinned)."""
    from benchmarks.studies.baselines import PinnedPlanPrefetch
    from benchmarks.studies.graph_e2e import equal_plan
    from benchmarks.studies.recording import RecordingEngine
    from polykv_agents.chat.chat_model import ChatPolyKV

    engine = RecordingEngine()
    chat = ChatPolyKV(model=model, max_tokens=max_tokens, ignore_eos=True, engine=engine, weights=weights)
    return workflow.build_graph(prefetch=PinnedPlanPrefetch(chat, engine=engine, plan=equal_plan)), engine


def measure(request: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, then the review and the probe over each document."""
    from benchmarks.studies.graph_e2e import _document, run_graph
    from benchmarks.studies.ours_side import probe
    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.model.weights import weights_of

    workflow = load_workflow("document_review", Path(request["graphs"]))
    graph, engine = pooled_graph(workflow, request["model"], request["max_tokens"], request["weights"])
    started = time.perf_counter()
    model, tokenizer = engine.load_model(request["model"], weights=request["weights"])
    load_s = time.perf_counter() - started
    rss_after_load = rss_bytes()
    roles = request["roles"]
    started = time.perf_counter()
    run_graph(graph, engine, _document(tokenizer, request["texts"][0], 256, run=-1), roles[:3])
    warm_up_s = time.perf_counter() - started
    result: dict[str, Any] = {"reviews": [], "replays": [], "probes": [], "probe_ids": []}
    for index, text in enumerate(request["texts"]):
        document = _document(tokenizer, text, request["context"], index)
        run, calls = run_graph(graph, engine, document, roles)
        result["reviews"].append(
            {"wall_s": run.wall_s, "stage_s": run.stage_s, "calls": len(calls),
             "output_tokens": sum(c.output_tokens for c in calls)}
        )  # fmt: skip
        result["replays"].append(
            [{"node": c.node, "input_ids": c.input_ids, "output_tokens": c.output_tokens} for c in calls]
        )
        figures, ids = probe(model, tokenizer, document, request["max_tokens"], compiled=False)
        result["probes"].append(figures)
        result["probe_ids"].append(ids)
    engine.close()
    result.update(load_s=load_s, warm_up_s=warm_up_s, rss_after_load_bytes=rss_after_load,
                  rss_peak_bytes=peak_rss_bytes(), weights=weights_of(model))  # fmt: skip
    return result


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    Path(result_path).write_text(json.dumps(measure(request)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
