"""One measurement of ``polykv-agents bench serve``, in a fresh process of its own (so its peak RSS is its own):

    python -m polykv_agents.bench.serve_worker REQUEST.json RESULT.json

Request: ``{"mode", "graph", "graphs", "texts", "context", "roles", "max_tokens", "model"}``. ``mode`` is ``"at_once"``
(every workflow started together, one thread each), ``"one_after_another"`` (the same workflows in turn, in this
process) or ``"server"`` (started together through ``langgraph dev``'s in-memory server, started here, one
``langgraph_sdk`` client per workflow). Workflow ``i`` reviews the first ``context`` tokens of ``texts[i]``.
Result: per workflow its latency, time to its first streamed token and output tokens; the wall time; peak RSS.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

GENERIC_ROLES = ("procurement", "quality", "audit", "strategy", "data", "marketing", "sales", "support")


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` memory field (``VmHWM``: peak RSS; ``VmRSS``: RSS now) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    msg = f"no {field} in /proc/{pid}/status: the serving benchmark measures memory on Linux only"
    raise RuntimeError(msg)


def role_names(module, count: int) -> list[str]:
    """``count`` roles: the graph's own (``ROLE_PROMPTS``), then generic ones."""
    return [*getattr(module, "ROLE_PROMPTS", {}), *GENERIC_ROLES][:count]


def documents(texts: list[str], tokens: int, model: str | None) -> list[str]:
    """The first ``tokens`` tokens of each text, by ``model``'s tokenizer (loading it: part of the warm-up)."""
    from polykv_agents.engine import load_model

    _, tokenizer = load_model(model)
    return [tokenizer.decode(tokenizer(text).input_ids[:tokens], skip_special_tokens=True) for text in texts]


def output_tokens(messages: list) -> int:
    """Tokens the model wrote in a run: the sum of its messages' ``usage_metadata.output_tokens``."""
    total = 0
    for message in messages:
        usage = message.get("usage_metadata") if isinstance(message, dict) else getattr(message, "usage_metadata", None)
        total += (usage or {}).get("output_tokens", 0)
    return total


def run_in_process(graph, inputs: dict, context: dict, started: float) -> dict[str, Any]:
    """One workflow through ``graph.stream``: its latency and first streamed token, from ``started``."""
    first, values = None, {}
    for mode, chunk in graph.stream(inputs, context=context, stream_mode=["messages", "values"]):
        if mode == "messages" and first is None and getattr(chunk[0], "content", ""):
            first = time.perf_counter() - started
        elif mode == "values":
            values = chunk
    return {
        "latency_s": time.perf_counter() - started,
        "ttft_s": first,
        "output_tokens": output_tokens(values.get("messages", [])),
    }


def run_through_server(url: str, graph: str, inputs: dict, context: dict, started: float) -> dict[str, Any]:
    """One workflow as a LangGraph client runs it: a thread, a streamed run, the thread's final state."""
    import langgraph_sdk

    client = langgraph_sdk.get_sync_client(url=url)
    thread = client.threads.create()["thread_id"]
    first = None
    for part in client.runs.stream(thread, graph, input=inputs, context=context, stream_mode="messages-tuple"):
        if part.event == "error":
            msg = f"the server's run failed: {part.data}"
            raise RuntimeError(msg)
        if part.event == "messages" and first is None and part.data[0].get("content"):
            first = time.perf_counter() - started
    latency = time.perf_counter() - started
    state = client.threads.get_state(thread)
    return {"latency_s": latency, "ttft_s": first, "output_tokens": output_tokens(state["values"].get("messages", []))}


def measure(request: dict[str, Any]) -> dict[str, Any]:
    from polykv_agents.graph.dev_server import DevServer
    from polykv_agents.graph.langgraph_config import load_workflow

    config = Path(request["graphs"])
    module = load_workflow(request["graph"], config)
    roles = role_names(module, request["roles"])
    docs = documents(request["texts"], request["context"], request["model"])
    warm_up = documents(request["texts"][:1], min(256, request["context"]), request["model"])[0]
    context = {"max_tokens": request["max_tokens"], "ignore_eos": True}
    if request["model"] is not None:
        context["model"] = request["model"]
    jobs = [({"document": d, "roles": roles}, context) for d in docs]
    mode = request["mode"]
    result: dict[str, Any] = {}
    if mode == "server":
        # A fresh server (its peak RSS is this run's); no pool store, as in this process: equal work.
        with DevServer(config, jobs=max(10, len(jobs)), env={"POLYKV_POOL_STORE": ""}) as server:
            run_through_server(
                server.url, request["graph"], {"document": warm_up, "roles": roles[:3]}, context, time.perf_counter()
            )  # fmt: skip  (the server loads the model here)
            result["runs"], result["wall_s"] = start_together(
                lambda job, t: run_through_server(server.url, request["graph"], *job, t), jobs
            )
            result["rss_peak_bytes"] = status_bytes("VmHWM", server.process.pid)
        return result
    graph = module.graph
    run_in_process(graph, {"document": warm_up, "roles": roles[:3]}, context, time.perf_counter())
    if mode == "at_once":
        result["runs"], result["wall_s"] = start_together(lambda job, t: run_in_process(graph, *job, t), jobs)
    else:
        started = time.perf_counter()
        result["runs"] = [run_in_process(graph, *job, time.perf_counter()) for job in jobs]
        result["wall_s"] = time.perf_counter() - started
    result["rss_peak_bytes"] = status_bytes("VmHWM")
    return result


def start_together(run, jobs: list) -> tuple[list[dict], float]:
    """Every job started together (one thread each, released by one barrier): ``run(job, started)`` for each, with
    ``started`` the moment the barrier released them; their results and the wall time."""
    barrier = threading.Barrier(len(jobs) + 1)

    def start(job):
        barrier.wait()
        return run(job, started)

    with ThreadPoolExecutor(len(jobs)) as threads:
        futures = [threads.submit(start, job) for job in jobs]
        started = time.perf_counter()
        barrier.wait()
        runs = [future.result() for future in futures]
    return runs, time.perf_counter() - started


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    Path(result_path).write_text(json.dumps(measure(request)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
