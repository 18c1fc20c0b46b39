"""Role swarm: N roles answer one question about one document in parallel, then one call merges them.

Data flow (state keys in brackets):
  [document, question, roles?] -> check_input: defaults the role list, refuses an empty one or more
      than MAX_ROLES, and a blank question, before anything is loaded
  -> prefetch: the document is prefilled and compressed once -> [pool] (a PoolHandle as plain JSON, never tensors)
  -> dispatch_roles: one ``Send("role_answer", RoleTask)`` per role, run in parallel
  -> role_answer x N: one pooled call each -> [answers] += {role, text, cache_read, pool_digest}
  -> aggregate: one pooled call that merges the answers -> [answer]
Every call gets its chat model from ``prefetch.pooled_chat(state)``, so it reads the document from
the pool (``cache_read`` >= pool tokens). Each AIMessage is appended to [messages], named after its role.

    from graphs.role_swarm import build_graph
    swarm = build_graph(max_tokens=64)
    result = swarm.invoke({"document": text, "question": "What is the main risk?", "roles": ["skeptic", "analyst"]})
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from langchain_core.messages import AnyMessage, BaseMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from langgraph.runtime import Runtime
from langgraph.types import Checkpointer, Send
from typing_extensions import NotRequired, TypedDict

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.engine import Engine
from polykv_agents.graph.context import PolyKVContext, run_context
from polykv_agents.graph.prefetch import PrefetchDocument
from polykv_agents.graph.workflow import (
    cache_read,
    check_roles,
    check_text,
    cluster_from_env,
    role_chat_model,
    with_parallel_roles,
)
from polykv_agents.pool.handle import PoolHandleState
from polykv_agents.pool.store import PoolStore

if TYPE_CHECKING:
    from polykv_agents.distributed import RayCluster

DEFAULT_MAX_TOKENS = 128
"""Tokens per answer when ``build_graph`` makes its own chat model."""

ROLE_PROMPTS: dict[str, str] = {
    "analyst": "You are the analyst. You answer from the facts and figures in the document.",
    "skeptic": "You are the skeptic. You question claims and point out what the document does not show.",
    "optimist": "You are the optimist. You point out strengths and opportunities in the document.",
    "economist": "You are the economist. You answer in terms of costs, prices and incentives.",
    "engineer": "You are the engineer. You answer in terms of infrastructure and what is technically feasible.",
    "lawyer": "You are the lawyer. You answer in terms of obligations, rights and compliance.",
    "customer": "You are a customer. You answer as someone who uses the service every day.",
}
"""Role name -> system prompt; a role not listed gets :data:`GENERIC_ROLE_PROMPT`."""

GENERIC_ROLE_PROMPT = "You are the {role}. You answer from the {role}'s point of view."

DEFAULT_ROLES: tuple[str, ...] = ("analyst", "skeptic", "optimist")

AGGREGATOR_PROMPT = "You are the moderator. You merge several answers into one balanced answer."


class InputState(TypedDict):
    """What a run takes."""

    document: str
    """The document text every role reads (prefilled once into the pool)."""
    question: str
    """The one question every role answers."""
    roles: NotRequired[list[str]]
    """Roles, 1 to MAX_ROLES distinct names; default :data:`DEFAULT_ROLES`."""


class RoleAnswer(TypedDict):
    """One role's answer, with what the call measured."""

    role: str
    text: str
    cache_read: int
    """Tokens read instead of prefilled (``usage_metadata["input_token_details"]["cache_read"]``): the pool's, and
    any of the call's own that earlier calls over the pool had run through the model."""
    pool_digest: str | None
    """The pool the answer was read from (``response_metadata["pool_digest"]``)."""


class State(InputState, total=False):
    """The swarm's state: small and serializable (the pool is a handle, the tensors stay in the registry)."""

    pool: PoolHandleState | None
    answers: Annotated[list[RoleAnswer], operator.add]
    answer: str
    """The aggregator's merged answer."""
    messages: Annotated[list[AnyMessage], add_messages]


class RoleTask(TypedDict):
    """What one parallel role branch gets (the payload of its ``Send``)."""

    role: str
    document: str
    pool: PoolHandleState
    question: str


# ---------------------------------------------------------------- input and prompts


def role_prompt(role: str) -> str:
    """The system prompt of ``role``: its own from :data:`ROLE_PROMPTS`, else the generic one."""
    return ROLE_PROMPTS.get(role, GENERIC_ROLE_PROMPT.format(role=role))


def role_messages(role: str, question: str) -> list[BaseMessage]:
    """What ``role`` is asked, after the shared document prefix."""
    return [SystemMessage(role_prompt(role)), HumanMessage(f"{question.strip()}\nAnswer in one or two sentences.")]


def aggregate_messages(question: str, answers: Sequence[RoleAnswer], roles: Sequence[str]) -> list[BaseMessage]:
    """The aggregator's request: the question and every answer, in role-list order."""
    order = {role: i for i, role in enumerate(roles)}
    ordered = sorted(answers, key=lambda a: order.get(a["role"], len(order)))
    listed = "\n".join(f"- {a['role']}: {a['text'].strip()}" for a in ordered)
    task = f"The question: {question.strip()}\n\nThe answers:\n{listed}\n\nMerge them into one answer of two sentences."
    return [SystemMessage(AGGREGATOR_PROMPT), HumanMessage(task)]


def check_input(state: State) -> dict[str, Any]:
    """Refuse bad input before the model is loaded or the document prefilled; default the roles."""
    check_text(state, "document")
    check_text(state, "question")
    return {"roles": check_roles(state.get("roles"), default=DEFAULT_ROLES)}


def dispatch_roles(state: State) -> list[Send]:
    """Fan out: one parallel ``role_answer`` branch per role (a ``Send`` router, so not a ``Literal``)."""
    return [
        Send(
            "role_answer",
            RoleTask(role=role, document=state["document"], pool=state["pool"], question=state["question"]),
        )
        for role in state["roles"]
    ]


# ---------------------------------------------------------------- the graph


def build_graph(
    *,
    chat: ChatPolyKV | None = None,
    store: PoolStore | str | Path | None = None,
    checkpointer: Checkpointer = None,
    max_tokens: int | None = None,
    name: str = "role_swarm",
    cluster: RayCluster | None = None,
    engine: Engine | None = None,
) -> CompiledStateGraph:
    """The compiled role-swarm graph. Nothing is loaded until the first run.

    Args:
        chat: The chat model every role uses (default: the embedded SmolLM2-135M-Instruct, greedy).
        store: Where pools are saved by digest, so a thread resumed in another process reloads its pool
            instead of prefilling the document again; ``None`` keeps pools in this process.
        checkpointer: A LangGraph checkpointer (e.g. ``InMemorySaver``, ``SqliteSaver``) for threads.
        max_tokens: Tokens per answer; overrides ``chat.max_tokens`` when given.
        name: The compiled graph's name.
        cluster: A :class:`polykv_agents.distributed.RayCluster`: the pool is built on one of its nodes and every
            role call runs on its workers, one model replica per node (``None``: all in this process).
        engine: The :class:`polykv_agents.Engine` that holds models, pools and schedulers (``None``: the default).
    """
    prefetch = PrefetchDocument(
        role_chat_model(chat, max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS, cluster=cluster),
        store=store,
        cluster=cluster,
        engine=engine,
    )

    def role_answer(task: RoleTask, runtime: Runtime[PolyKVContext]) -> dict[str, Any]:
        messages = role_messages(task["role"], task["question"])
        response = prefetch.invoke_role(task, task["role"], messages, context=run_context(runtime))
        answer = RoleAnswer(
            role=task["role"],
            text=str(response.text),
            cache_read=cache_read(response),
            pool_digest=response.response_metadata.get("pool_digest"),
        )
        return {"answers": [answer], "messages": [response]}

    def aggregate(state: State, runtime: Runtime[PolyKVContext]) -> dict[str, Any]:
        messages = aggregate_messages(state["question"], state["answers"], state["roles"])
        response = prefetch.invoke_role(state, "aggregator", messages, context=run_context(runtime))
        return {"answer": str(response.text), "messages": [response]}

    builder = StateGraph(State, input_schema=InputState, context_schema=PolyKVContext)
    builder.add_node("check_input", check_input)
    builder.add_node("prefetch", prefetch)
    builder.add_node("role_answer", role_answer)
    builder.add_node("aggregate", aggregate)
    builder.add_edge(START, "check_input")
    builder.add_edge("check_input", "prefetch")
    builder.add_conditional_edges("prefetch", dispatch_roles, ["role_answer"])
    builder.add_edge("role_answer", "aggregate")
    builder.add_edge("aggregate", END)
    return with_parallel_roles(builder.compile(checkpointer=checkpointer, name=name))


# For `langgraph dev` (langgraph.json): POLYKV_POOL_STORE names a pool directory, so threads resumed
# after a server restart reload their pool instead of prefilling the document again.
# POLYKV_RAY_ADDRESS sends the role calls to a Ray cluster (polykv_agents.graph.workflow.cluster_from_env).
graph = build_graph(store=os.environ.get("POLYKV_POOL_STORE") or None, cluster=cluster_from_env())
