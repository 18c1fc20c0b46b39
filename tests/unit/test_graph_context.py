"""The graphs' per-run settings (``context_schema=PolyKVContext``), the pool handle as plain JSON in state, and
the parallel-branches helper, on a tiny local checkpoint."""

from __future__ import annotations

import json
import logging
import operator
from typing import Annotated

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send
from pydantic import ValidationError
from typing_extensions import TypedDict
from usage import pool_read

from graphs import document_agent, document_review, role_swarm
from polykv_agents import (
    ChatPolyKV,
    CompressionConfig,
    Engine,
    PolyKVContext,
    PoolHandle,
    PoolHandleState,
    PrefetchDocument,
    ToolCallCutError,
    with_parallel_roles,
)
from polykv_agents.graph.workflow import MAX_ROLES

DOCUMENT = "The council delayed the library by a year: the lowest bid was 30 percent over budget. " * 3
QUESTION = "What was delayed?"


@pytest.fixture
def engine() -> Engine:
    return Engine()


def swarm(tiny_model_dir, engine, **kwargs):
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=6, engine=engine)
    return role_swarm.build_graph(chat=chat, **kwargs)


def run(graph, tag: str, **kwargs) -> dict:
    inputs = {"document": f"{DOCUMENT} {tag}", "question": QUESTION, "roles": ["analyst", "skeptic"]}
    return graph.invoke(inputs, **kwargs)


@pytest.mark.parametrize("module", [role_swarm, document_review, document_agent])
def test_every_graph_declares_the_context_a_studio_assistant_sets(module):
    schema = module.build_graph().get_context_jsonschema()
    assert {"model", "max_tokens", "runtime", "weights", "preset"} <= set(schema["properties"])


def test_the_run_context_sets_the_token_budget_of_every_call(tiny_model_dir, engine):
    graph = swarm(tiny_model_dir, engine)
    default = run(graph, "default")
    short = run(graph, "short", context={"max_tokens": 2})
    assert {m.usage_metadata["output_tokens"] for m in default["messages"]} == {6}
    assert {m.usage_metadata["output_tokens"] for m in short["messages"]} == {2}


def test_the_run_context_sets_the_pools_compression_preset(tiny_model_dir, engine):
    graph = swarm(tiny_model_dir, engine)
    default = run(graph, "preset")
    smallest = run(graph, "preset", context={"preset": "max"})
    assert PoolHandle.model_validate(smallest["pool"]).config == CompressionConfig.preset("max")
    assert smallest["pool"]["digest"] != default["pool"]["digest"]
    assert smallest["pool"]["nbytes"] < default["pool"]["nbytes"]
    assert {pool_read(m) for m in smallest["messages"]} == {smallest["pool"]["num_tokens"]}


def test_the_run_context_sets_the_runtime(tiny_model_dir, engine):
    """The private runtime decodes each call on its own copy of the pool: no batch scheduler is started."""
    run(swarm(tiny_model_dir, engine), "private", context={"runtime": "private"})
    assert len(engine.schedulers) == 0
    run(swarm(tiny_model_dir, engine), "batched")
    assert len(engine.schedulers) == 1


@pytest.mark.parametrize(
    ("context", "named"),
    [
        ({"max_token": 3}, "max_token"),
        ({"preset": "tiny"}, "default, paper, max, full"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_a_bad_context_is_refused_before_anything_runs(tiny_model_dir, engine, context, named):
    with pytest.raises(ValidationError, match=named):
        run(swarm(tiny_model_dir, engine), "bad", context=context)
    assert engine.pools.build_count == 0


def test_the_agent_graph_reads_the_run_context(long_context_model_dir, engine):
    """The agent's first call must call a tool (ToolFirstMiddleware): with the run's 3 tokens it cannot finish one."""
    chat = ChatPolyKV(model=long_context_model_dir, max_tokens=200, temperature=1.0, seed=0, engine=engine)
    agent = document_agent.build_graph(chat=chat, max_model_calls=1)
    with pytest.raises(ToolCallCutError, match="max_tokens=3 ran out"):
        agent.invoke({"messages": [HumanMessage(QUESTION)], "document": DOCUMENT}, context={"max_tokens": 3})


def test_the_state_holds_the_handle_as_plain_json(tiny_model_dir, engine):
    result = run(swarm(tiny_model_dir, engine), "json")
    pool = result["pool"]
    assert type(pool) is dict
    assert json.loads(json.dumps(pool)) == pool
    assert PoolHandle.model_validate(pool).to_state() == pool


def test_a_checkpointed_thread_resumes_without_an_unregistered_type_warning(tiny_model_dir, engine, tmp_path, caplog):
    config = {"configurable": {"thread_id": "t1"}}
    with SqliteSaver.from_conn_string(str(tmp_path / "threads.sqlite")) as saver:
        first = run(swarm(tiny_model_dir, engine, checkpointer=saver), "resume", config=config)
    with caplog.at_level(logging.DEBUG), SqliteSaver.from_conn_string(str(tmp_path / "threads.sqlite")) as saver:
        values = swarm(tiny_model_dir, engine, checkpointer=saver).get_state(config).values
    assert values["pool"] == first["pool"] and type(values["pool"]) is dict
    assert not [r for r in caplog.records if "unregistered type" in r.getMessage()]


def test_a_pool_handle_object_in_state_is_still_read(tiny_model_dir, engine):
    """State written by older code holds PoolHandle objects: role calls read them as they read the JSON form."""
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=3, engine=engine)
    prefetch = PrefetchDocument(chat, engine=engine)
    state = {"document": DOCUMENT}
    handle = PoolHandle.model_validate(prefetch(state)["pool"])
    reply = prefetch.invoke_role({**state, "pool": handle}, "analyst", [HumanMessage(QUESTION)])
    assert reply.usage_metadata["input_token_details"]["cache_read"] == handle.num_tokens


def test_with_parallel_roles_lets_every_branch_run_at_once(tiny_model_dir, engine):
    graph = role_swarm.build_graph(chat=ChatPolyKV(model=tiny_model_dir, engine=engine))
    assert graph.config["max_concurrency"] == MAX_ROLES + 1
    assert with_parallel_roles(graph, roles=4).config["max_concurrency"] == 5
    with pytest.raises(ValueError, match="at least 1"):
        with_parallel_roles(graph, roles=0)


def test_the_context_fields_are_the_chat_models(tiny_model_dir):
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=6)
    assert PolyKVContext().apply_to_chat(chat) is chat
    changed = PolyKVContext(max_tokens=3, runtime="compressed", weights="int8").apply_to_chat(chat)
    assert (changed.max_tokens, changed.runtime, changed.weights, changed.model) == (
        3,
        "compressed",
        "int8",
        chat.model,
    )


def test_the_readme_graph_fans_out_over_one_pool_with_the_run_context(tiny_model_dir, engine):
    """README's own-StateGraph example, on the tiny checkpoint: one pool, every branch reads it, the context applies."""
    roles = ["legal", "finance", "operations"]
    prefetch = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=96, engine=engine))

    class State(TypedDict, total=False):
        document: str
        pool: PoolHandleState
        notes: Annotated[list[str], operator.add]

    replies = []

    def review(task: dict, runtime: Runtime[PolyKVContext]) -> dict:
        ask = [HumanMessage(f"As the {task['role']} reviewer, name the main risk in one sentence.")]
        reply = prefetch.invoke_role(task, task["role"], ask, context=runtime.context)
        replies.append(reply)
        return {"notes": [reply.text]}

    builder = StateGraph(State, context_schema=PolyKVContext)
    builder.add_node("prefetch", prefetch)
    builder.add_node("review", review)
    builder.add_edge(START, "prefetch")
    builder.add_conditional_edges("prefetch", lambda s: [Send("review", {**s, "role": r}) for r in roles], ["review"])
    graph = with_parallel_roles(builder.compile(), roles=len(roles))
    result = graph.invoke({"document": DOCUMENT}, context={"max_tokens": 5, "preset": "max"})
    assert len(result["notes"]) == 3 and engine.pools.build_count == 1
    assert result["pool"]["config"] == CompressionConfig.preset("max").model_dump(mode="json")
    assert {r.usage_metadata["output_tokens"] for r in replies} == {5}
    assert {r.usage_metadata["input_token_details"]["cache_read"] for r in replies} == {result["pool"]["num_tokens"]}
