"""The token ids of ``bench serve``'s workflows, for llama.cpp to replay (``python -m benchmarks serve_peers``), in
a fresh process of its own:

    python benchmarks/studies/serve_record_side.py REQUEST.json RESULT.json

It runs the serving benchmark's workflows one after another, as :mod:`polykv_agents.bench.serve_worker` runs
them (the same graph from the same ``langgraph.json``, the same documents, roles and run context, so the same
prompts), on a :class:`~benchmarks.studies.recording.RecordingEngine`, and returns every call each workflow
decoded: the node that made it, the tokens the model read and how many it decoded.

Request: ``{"graph", "graphs", "texts", "context", "roles", "max_tokens", "model"}`` (those of a serve worker).
Result: ``{"workflows": [[{"node", "input_ids", "output_tokens"}]]}``, one list of calls per text.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def record(request: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.studies.recording import RecordingEngine
    from polykv_agents.bench.serve_worker import documents, role_names, run_in_process
    from polykv_agents.graph.langgraph_config import load_workflow

    module = load_workflow(request["graph"], Path(request["graphs"]))
    engine = RecordingEngine()
    graph = module.build_graph(engine=engine)
    roles = role_names(module, request["roles"])
    context = {"max_tokens": request["max_tokens"], "ignore_eos": True}
    if request["model"] is not None:
        context["model"] = request["model"]
    workflows = []
    for document in documents(request["texts"], request["context"], request["model"]):
        run_in_process(graph, {"document": document, "roles": roles}, context, time.perf_counter())
        calls = engine.take_calls()
        workflows.append([{"node": c.node, "input_ids": c.input_ids, "output_tokens": c.output_tokens} for c in calls])
    engine.close()
    return {"workflows": workflows}


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    Path(result_path).write_text(json.dumps(record(request)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
