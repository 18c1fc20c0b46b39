"""The graphs as ``langgraph dev`` serves them (langgraph.json), driven over HTTP by ``langgraph_sdk``.

The in-memory LangGraph API server (``langgraph-cli[inmem]``) starts on a free port with the repository's
langgraph.json (its graph paths made absolute, its pool store in a temporary directory). A ``role_swarm`` run
pauses before the aggregator; the server is stopped by its pid and started again; the same thread resumes, and
the aggregator's call finds the pool in the store instead of prefilling the document again. The run's context
(``PolyKVContext``) points the graph at the tiny test checkpoint, so each server start loads in seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

langgraph_sdk = pytest.importorskip("langgraph_sdk")
pytest.importorskip("langgraph_runtime_inmem", reason="needs langgraph-cli[inmem] (the dev extra)")

from polykv_agents.graph.dev_server import DevServer  # noqa: E402  (after the skips: it needs neither)

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = "The council delayed the library by a year: the lowest bid was 30 percent over budget. " * 4
ROLES = ["analyst", "skeptic", "optimist"]


@contextmanager
def dev_server(directory: Path) -> Iterator[str]:
    """``langgraph dev`` on the repository's langgraph.json, running in ``directory`` (where it keeps its threads
    between starts) with its pool store there too; its URL."""
    pools = {"POLYKV_POOL_STORE": str(directory / "pools")}
    with DevServer(ROOT / "langgraph.json", folder=directory, env=pools) as server:
        yield server.url


def test_role_swarm_over_http_survives_a_server_restart(tmp_path, tiny_model_dir):
    context = {"model": tiny_model_dir, "max_tokens": 4}
    inputs = {"document": DOCUMENT, "question": "What was delayed?", "roles": ROLES}

    with dev_server(tmp_path) as url:
        client = langgraph_sdk.get_sync_client(url=url)
        thread = client.threads.create()
        pause = ["aggregate"]
        client.runs.wait(thread["thread_id"], "role_swarm", input=inputs, context=context, interrupt_before=pause)
        state = client.threads.get_state(thread["thread_id"])
    assert state["next"] == ["aggregate"]
    pool = state["values"]["pool"]
    answers = state["values"]["answers"]
    assert sorted(a["role"] for a in answers) == sorted(ROLES)
    assert all(a["cache_read"] >= pool["num_tokens"] for a in answers)  # and any reused tokens of earlier calls
    assert {a["pool_digest"] for a in answers} == {pool["digest"]}
    assert [p.name for p in (tmp_path / "pools").iterdir()] == [f"{pool['digest']}.safetensors"]  # one pool built

    with dev_server(tmp_path) as url:  # a new process: nothing in memory but the threads it reloaded
        client = langgraph_sdk.get_sync_client(url=url)
        client.runs.wait(thread["thread_id"], "role_swarm", input=None, context=context)
        state = client.threads.get_state(thread["thread_id"])
    assert state["next"] == []
    aggregator = state["values"]["messages"][-1]
    assert aggregator["name"] == "aggregator"
    assert aggregator["response_metadata"]["pool_source"] == "store"
    assert aggregator["response_metadata"]["pool_digest"] == pool["digest"]
    usage, metadata = aggregator["usage_metadata"], aggregator["response_metadata"]
    assert usage["input_token_details"]["cache_read"] - metadata["reused_tokens"] == pool["num_tokens"]
