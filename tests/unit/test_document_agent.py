"""The ReAct-style document agent (graphs/document_agent.py, LangChain's create_agent + this package's
middleware) on a tiny random checkpoint: one pool per document, every model call reads it, tool calls parse,
and a loop that would never stop ends cleanly at its limit of model calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelCallLimitMiddleware
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.sqlite import SqliteSaver
from usage import pool_read, reused

from graphs import document_agent
from polykv_agents import default_engine
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.graph.middleware import DocumentPoolMiddleware

DOCUMENT = (
    "# Register\n\nDrought is the first risk: the reservoir fell to 41 percent.\n\n"
    "Leakage is the second risk: non-revenue water rose from 16.8 to 19.4 percent.\n\n"
    "The workforce is the third risk: a quarter of the staff retire within five years."
)


class AlwaysCallATool(AgentMiddleware):
    """Every model call must call a tool: without a limit, the loop would never end."""

    def wrap_model_call(self, request, handler):
        return handler(request.override(tool_choice="any"))

    async def awrap_model_call(self, request, handler):
        return await handler(request.override(tool_choice="any"))


@pytest.fixture
def chat(long_context_model_dir) -> ChatPolyKV:
    return ChatPolyKV(model=long_context_model_dir, max_tokens=200, temperature=1.0, seed=0)


def ask(agent, tag: str, **config):
    question = HumanMessage("What is the first risk?")
    return agent.invoke({"messages": [question], "document": f"{DOCUMENT} {tag}"}, config)


def model_calls(state) -> list[AIMessage]:
    return [m for m in state["messages"] if isinstance(m, AIMessage) and m.usage_metadata]


def test_a_loop_that_never_stops_calling_tools_ends_at_its_limit(chat):
    """The graph's agent, with a policy that never lets it answer: the call limit ends the run with a message."""
    agent = create_agent(
        chat,
        tools=document_agent.TOOLS,
        middleware=[
            DocumentPoolMiddleware(chat),
            AlwaysCallATool(),
            ModelCallLimitMiddleware(run_limit=3, exit_behavior="end"),
        ],
    )
    builds_before = default_engine().pools.build_count
    state = ask(agent, "limit")
    final = state["messages"][-1]
    assert isinstance(final, AIMessage) and final.text == "Model call limits exceeded: run limit (3/3)"
    calls = model_calls(state)
    assert len(calls) == 3 and all(m.tool_calls for m in calls)
    assert sum(isinstance(m, ToolMessage) for m in state["messages"]) == 3
    assert default_engine().pools.build_count - builds_before == 1
    assert {pool_read(m) for m in calls} == {state["pool"]["num_tokens"]}
    # Each step extends the last one's conversation: it reads that from the prefix tree, and more at every step.
    assert 0 == reused(calls[0]) < reused(calls[1]) < reused(calls[2])


def test_the_first_model_call_looks_something_up_and_every_call_reads_the_pool(chat):
    state = ask(document_agent.build_graph(chat=chat), "tool-first")
    calls = model_calls(state)
    assert calls[0].tool_calls, "ToolFirstMiddleware: the first answer calls a tool"
    assert calls[0].tool_calls[0]["name"] in {"search_document", "percent_change"}
    results = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert results and results[0].tool_call_id == calls[0].tool_calls[0]["id"]
    assert len(calls) <= document_agent.MAX_MODEL_CALLS
    assert {pool_read(m) for m in calls} == {state["pool"]["num_tokens"]}


async def test_the_agent_runs_async(chat):
    agent = document_agent.build_graph(chat=chat, max_model_calls=2)
    state = await agent.ainvoke({"messages": [HumanMessage("Leakage?")], "document": f"{DOCUMENT} async"})
    assert model_calls(state)[0].tool_calls


def test_a_second_question_in_a_checkpointed_thread_reuses_the_pool(chat, tmp_path):
    with SqliteSaver.from_conn_string(str(tmp_path / "threads.sqlite")) as saver:
        agent = document_agent.build_graph(chat=chat, max_model_calls=2, checkpointer=saver)
        config = {"configurable": {"thread_id": "t1"}}
        first = ask(agent, "thread", **config)
        builds_before = default_engine().pools.build_count
        second = agent.invoke({"messages": [HumanMessage("And the second risk?")]}, config)
        assert default_engine().pools.build_count == builds_before
        assert second["pool"] == first["pool"]
        assert len(second["messages"]) > len(first["messages"])


def test_the_agents_model_must_be_a_pooled_chat_model(chat):
    other = FakeMessagesListChatModel(responses=[AIMessage("hi")])
    agent = create_agent(other, tools=[], middleware=[DocumentPoolMiddleware(chat)])
    with pytest.raises(TypeError, match="create the agent with a ChatPolyKV"):
        ask(agent, "fake")


def test_the_tools_search_paragraphs_and_compute_changes():
    runtime = SimpleNamespace(state={"document": DOCUMENT})
    found = document_agent.search_document.func("leakage percent", runtime)
    assert "Leakage is the second risk" in found and "workforce" not in found  # the best two, in document order
    assert document_agent.search_document.func("workforce", runtime).startswith("The workforce is the third risk")
    assert "No paragraph" in document_agent.search_document.func("zebra", runtime)
    assert document_agent.percent_change.invoke({"old": 16.8, "new": 19.4}) == "+15.5%"
    assert document_agent.percent_change.invoke({"old": 0, "new": 1}) == "undefined: old is 0"
