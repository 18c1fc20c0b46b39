"""Document agent: a ReAct-style agent (LangChain's ``create_agent``, the current form of LangGraph's
``create_react_agent``) with two small tools, reading its document from one shared, compressed pool.

Data flow (state keys in brackets):
  [messages, document] -> DocumentPoolMiddleware (before the agent): the document is prefilled and
      compressed once -> [pool] (a PoolHandle as plain JSON, never tensors)
  -> model: ChatPolyKV bound to the pool, tools bound, each answer decoded under the tools' grammar, so
      a tool call always parses (``AIMessage.tool_calls`` with ids)
     <-> tools: ``search_document`` (paragraphs of [document] that match a query), ``percent_change``
  -> ends when the model answers in text, or after ``max_model_calls`` model calls: the limit ends the
     run with a final message (ModelCallLimitMiddleware, ``exit_behavior="end"``), never an error.
Every model call reads the document from the pool, however many steps the loop takes, and each step also
reads the conversation so far (the last step's prompt and answer) from the pool's prefix tree: it
prefills only the tool's result and what follows (``cache_read`` = pool tokens + those reused). With
``tool_first`` (the default), the model must call a tool until one has answered:
SmolLM2-135M, asked with ``tool_choice="auto"``, answers from memory instead of looking anything up.

    from graphs.document_agent import build_graph
    agent = build_graph(max_tokens=64)
    result = agent.invoke({"messages": [HumanMessage("How much did leakage fall?")], "document": text})
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated

from langchain.agents import create_agent
from langchain.agents.middleware import ModelCallLimitMiddleware
from langchain.tools import ToolRuntime, tool
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Checkpointer
from pydantic import Field

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.engine import Engine
from polykv_agents.graph.context import PolyKVContext
from polykv_agents.graph.middleware import DocumentPoolMiddleware, ToolFirstMiddleware
from polykv_agents.graph.workflow import role_chat_model
from polykv_agents.pool.store import PoolStore

DEFAULT_MAX_TOKENS = 96
"""Tokens per model call when ``build_graph`` makes its own chat model."""

MAX_MODEL_CALLS = 4
"""Model calls one run may make by default: a search, maybe another, then the answer."""

SEARCH_RESULTS = 2
"""Paragraphs ``search_document`` returns at most."""

QUERY_CHARS = 80
"""Longest query ``search_document`` takes: the grammar then bounds the call, so a model that loops inside the
query string still closes the call within its token budget."""

SYSTEM_PROMPT = (
    "You answer questions about the document above. Look facts up with search_document, compute changes "
    "with percent_change, then answer in one or two sentences."
)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _paragraphs(document: str) -> list[str]:
    """The document's paragraphs (blank-line separated), headings left out."""
    return [block.strip() for block in re.split(r"\n\s*\n", document) if block.strip() and block.strip()[0] != "#"]


@tool
def search_document(query: Annotated[str, Field(max_length=QUERY_CHARS)], runtime: ToolRuntime) -> str:
    """Find the paragraphs of the document that best match the query."""
    paragraphs = _paragraphs(runtime.state["document"])
    words = [_words(paragraph) for paragraph in paragraphs]
    # Rarer words weigh more (inverse document frequency), so "leakage" outranks "much" and "the".
    weight = {w: math.log(1 + len(paragraphs) / sum(w in ws for ws in words)) for w in set().union(*words)}
    scores = [sum(weight[w] for w in _words(query) & ws) for ws in words]
    best = sorted(range(len(paragraphs)), key=lambda i: scores[i], reverse=True)[:SEARCH_RESULTS]
    hits = [paragraphs[i] for i in sorted(best) if scores[i] > 0]
    return "\n\n".join(hits) if hits else f"No paragraph of the document matches {query!r}."


@tool
def percent_change(old: float, new: float) -> str:
    """The change from old to new, in percent of old."""
    if old == 0:
        return "undefined: old is 0"
    return f"{(new - old) / abs(old) * 100:+.1f}%"


TOOLS = [search_document, percent_change]


def build_graph(
    *,
    chat: ChatPolyKV | None = None,
    max_tokens: int | None = None,
    max_model_calls: int = MAX_MODEL_CALLS,
    tool_first: bool = True,
    store: PoolStore | str | Path | None = None,
    checkpointer: Checkpointer = None,
    name: str = "document_agent",
    engine: Engine | None = None,
) -> CompiledStateGraph:
    """The compiled agent. Nothing is loaded until the first run.

    Args:
        chat: The chat model (default: the embedded SmolLM2-135M-Instruct, greedy).
        max_tokens: Tokens per model call; overrides ``chat.max_tokens`` when given.
        max_model_calls: Model calls per run; the run then ends with a final message saying so.
        tool_first: Make the model call a tool until one has answered (:class:`ToolFirstMiddleware`).
        store: Where pools are saved by digest (see :class:`polykv_agents.graph.prefetch.PrefetchDocument`).
        checkpointer: A LangGraph checkpointer for threads.
        name: The compiled graph's name.
        engine: The :class:`polykv_agents.Engine` that holds models, pools and schedulers (``None``: ``chat``'s).
    """
    chat = role_chat_model(chat, max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS)
    if engine is not None:
        chat = chat.model_copy(update={"engine": engine})
    middleware = [DocumentPoolMiddleware(chat, store=store)]
    if tool_first:
        middleware.append(ToolFirstMiddleware())
    middleware.append(ModelCallLimitMiddleware(run_limit=max_model_calls, exit_behavior="end"))
    return create_agent(
        chat,
        tools=TOOLS,
        system_prompt=SYSTEM_PROMPT,
        middleware=middleware,
        checkpointer=checkpointer,
        name=name,
        context_schema=PolyKVContext,
    )


# For `langgraph dev` (langgraph.json), as the other graphs.
graph = build_graph(store=os.environ.get("POLYKV_POOL_STORE") or None)
