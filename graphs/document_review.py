"""Document review: specialists review one document in parallel, reading it from one shared pool.

Data flow (state keys in brackets):
  [document, roles?] -> check_input: defaults the role list, refuses an empty one or more than
      MAX_ROLES, before anything is loaded
  -> prefetch: the document is prefilled and compressed once -> [pool] (a PoolHandle as plain JSON, never tensors)
  -> planner: one pooled call under structured output -> [plan]: a typed list of {role, focus}, one per role,
      decoded under the grammar of :func:`plan_schema`, so it always parses
  -> assign_specialists: one ``Send("specialist", SpecialistTask)`` per plan entry, run in parallel
  -> specialist x N: one pooled call each, asked to check its entry's focus
      -> [findings] += {role, text, cache_read, pool_digest}
  -> critic: one pooled call over the findings -> [critique]
  -> summarizer: one pooled call that continues the critic's conversation (findings, question, critique) with
      its own turn -> [summary]. Its prompt extends the critic's tokens, so the engine's prefix tree serves all
      of them and only the summarizer's turn is prefilled (``cache_read`` = pool tokens + the critic's).
Every call gets its chat model from ``prefetch.pooled_chat(state)``, so it reads the document from
the pool (``cache_read`` >= pool tokens) instead of prefilling it again. Each AIMessage is also
appended to [messages], named after its role, for LangGraph Studio.

    from graphs.document_review import build_graph
    review = build_graph(max_tokens=64)
    result = review.invoke({"document": text, "roles": ["legal", "finance", "risk"]})
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage, SystemMessage
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
    "legal": "You are the legal specialist. You look for obligations, liabilities and compliance issues.",
    "finance": "You are the finance specialist. You check figures, budgets, costs and financial risks.",
    "engineering": "You are the engineering specialist. You assess technical feasibility and infrastructure.",
    "risk": "You are the risk specialist. You identify what could go wrong and how likely it is.",
    "operations": "You are the operations specialist. You look at staffing, processes and day-to-day delivery.",
    "security": "You are the security specialist. You look for threats to people, systems and data.",
    "environment": "You are the environment specialist. You assess environmental impact and sustainability.",
    "customer": "You are the customer specialist. You judge the effect on customers and service quality.",
    "communications": "You are the communications specialist. You check clarity and what the public is told.",
    "hr": "You are the human-resources specialist. You look at people, skills and workload.",
}
"""Role name -> system prompt; a role not listed gets :data:`GENERIC_ROLE_PROMPT`."""

GENERIC_ROLE_PROMPT = "You are the {role} specialist. You review the document from the {role} point of view."

DEFAULT_ROLES: tuple[str, ...] = ("legal", "finance", "engineering", "risk", "operations")

PLANNER_PROMPT = "You are the review planner. You decide what each specialist should check."

PLAN_FOCUS_CHARS = 60
"""Longest focus the plan may give one specialist. It bounds the plan's JSON, so the planner's token budget
(:func:`plan_token_budget`) always lets it finish: a small model that loops inside a string is cut by the grammar."""
CRITIC_PROMPT = "You are the critic. You look for findings that are weak, vague or not supported by the document."
SUMMARIZER_PROMPT = "You are the summarizer. You write short, plain summaries for the board."


class InputState(TypedDict):
    """What a run takes."""

    document: str
    """The document text every role reads (prefilled once into the pool)."""
    roles: NotRequired[list[str]]
    """Specialist roles, 1 to MAX_ROLES distinct names; default :data:`DEFAULT_ROLES`."""


class Finding(TypedDict):
    """One specialist's answer, with what the call measured."""

    role: str
    text: str
    cache_read: int
    """Tokens read instead of prefilled (``usage_metadata["input_token_details"]["cache_read"]``): the pool's, and
    any of the call's own that earlier calls over the pool had run through the model."""
    pool_digest: str | None
    """The pool the answer was read from (``response_metadata["pool_digest"]``)."""


class Assignment(TypedDict):
    """One entry of the typed review plan: what one specialist checks."""

    role: str
    focus: str
    """At most :data:`PLAN_FOCUS_CHARS` characters, written by the planner."""


class State(InputState, total=False):
    """The review's state: small and serializable (the pool is a handle, the tensors stay in the registry)."""

    pool: PoolHandleState | None
    plan: list[Assignment]
    """One entry per role, in role order; it drives the fan-out."""
    findings: Annotated[list[Finding], operator.add]
    critique: str
    summary: str
    messages: Annotated[list[AnyMessage], add_messages]


class SpecialistTask(TypedDict):
    """What one parallel specialist branch gets (the payload of its ``Send``)."""

    role: str
    document: str
    pool: PoolHandleState
    focus: str
    """The plan's focus for this role."""


# ---------------------------------------------------------------- input and prompts


def role_prompt(role: str) -> str:
    """The system prompt of ``role``: its own from :data:`ROLE_PROMPTS`, else the generic one."""
    return ROLE_PROMPTS.get(role, GENERIC_ROLE_PROMPT.format(role=role))


def plan_schema(roles: Sequence[str]) -> dict[str, Any]:
    """The JSON schema of the plan for ``roles``: one property per role (all required, in role order), each a
    focus of 1 to :data:`PLAN_FOCUS_CHARS` characters without quotes, backslashes or control characters (no
    escapes, so the focus's length bounds its JSON)."""
    focus = rf'^[^"\\\x00-\x1f]{{1,{PLAN_FOCUS_CHARS}}}$'
    return {
        "title": "ReviewPlan",
        "description": "What each specialist should check in the document.",
        "type": "object",
        "properties": {
            role: {"type": "string", "pattern": focus, "description": f"What the {role} specialist checks."}
            for role in roles
        },
        "required": list(roles),
        "additionalProperties": False,
    }


def plan_token_budget(roles: Sequence[str]) -> int:
    """Tokens that always suffice for the plan: its JSON's longest UTF-8 length (braces, each ``"role": "focus"``
    at 4 bytes per focus character, separators), since every token adds at least one byte."""
    entries = sum(len(json.dumps(role)) + len(': ""') + 4 * PLAN_FOCUS_CHARS for role in roles)
    return len("{}") + entries + len(", ") * (len(roles) - 1)


def planner_messages(roles: Sequence[str]) -> list[BaseMessage]:
    task = (
        f"The specialists are: {', '.join(roles)}. For each specialist, say in a few words which part of the "
        "document they should check."
    )
    return [SystemMessage(PLANNER_PROMPT), HumanMessage(task)]


def specialist_messages(role: str, focus: str) -> list[BaseMessage]:
    """What specialist ``role`` is asked, after the shared document prefix, given its focus from the plan."""
    task = (
        f"Your focus, from the review plan: {focus.strip()}\n\nAs the {role} specialist, state your most important "
        "finding about the document in one or two sentences."
    )
    return [SystemMessage(role_prompt(role)), HumanMessage(task)]


def format_findings(findings: Sequence[Finding], roles: Sequence[str]) -> str:
    """Findings as ``- role: text`` lines, in role-list order (parallel branches finish in any order)."""
    order = {role: i for i, role in enumerate(roles)}
    ordered = sorted(findings, key=lambda f: order.get(f["role"], len(order)))
    return "\n".join(f"- {f['role']}: {f['text'].strip()}" for f in ordered)


def critic_messages(findings: Sequence[Finding], roles: Sequence[str]) -> list[BaseMessage]:
    task = (
        f"The specialists' findings:\n{format_findings(findings, roles)}\n\nWhich finding is weakest or least "
        "supported by the document, and why? Answer in one or two sentences."
    )
    return [SystemMessage(CRITIC_PROMPT), HumanMessage(task)]


def summarizer_messages(findings: Sequence[Finding], roles: Sequence[str], critique: str) -> list[BaseMessage]:
    """The critic's conversation (findings, its question, its answer), then the summarizer's turn: its prompt
    extends the critic's tokens, so it reads them from the pool's prefix tree and prefills only its own turn."""
    return [
        *critic_messages(findings, roles),
        AIMessage(critique),
        SystemMessage(SUMMARIZER_PROMPT),
        HumanMessage("Summarise the review, with the critic's view, in three sentences."),
    ]


def check_input(state: State) -> dict[str, Any]:
    """Refuse bad input before the model is loaded or the document prefilled; default the roles."""
    check_text(state, "document")
    return {"roles": check_roles(state.get("roles"), default=DEFAULT_ROLES)}


def assign_specialists(state: State) -> list[Send]:
    """Fan out: one parallel ``specialist`` branch per entry of the typed plan (a ``Send`` router, so not a
    ``Literal``)."""
    return [
        Send(
            "specialist",
            SpecialistTask(role=entry["role"], focus=entry["focus"], document=state["document"], pool=state["pool"]),
        )
        for entry in state["plan"]
    ]


# ---------------------------------------------------------------- the graph


def build_graph(
    *,
    chat: ChatPolyKV | None = None,
    store: PoolStore | str | Path | None = None,
    checkpointer: Checkpointer = None,
    max_tokens: int | None = None,
    name: str = "document_review",
    cluster: RayCluster | None = None,
    engine: Engine | None = None,
    prefetch: PrefetchDocument | None = None,
) -> CompiledStateGraph:
    """The compiled document-review graph. Nothing is loaded until the first run.

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
        prefetch: A prefetch node to use instead of one made from the arguments above, e.g. the no-pool
            baseline benchmarks compare with (:class:`benchmarks.studies.baselines.ReprefillDocument`).
    """
    if prefetch is None:
        prefetch = PrefetchDocument(
            role_chat_model(chat, max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS, cluster=cluster),
            store=store,
            cluster=cluster,
            engine=engine,
        )

    def planner(state: State, runtime: Runtime[PolyKVContext]) -> dict[str, Any]:
        roles = state["roles"]
        focus, response = prefetch.invoke_role_structured(
            state,
            "planner",
            planner_messages(roles),
            plan_schema(roles),
            max_tokens=plan_token_budget(roles),
            context=run_context(runtime),
        )
        plan = [Assignment(role=role, focus=focus[role]) for role in roles]
        return {"plan": plan, "messages": [response]}

    def specialist(task: SpecialistTask, runtime: Runtime[PolyKVContext]) -> dict[str, Any]:
        role = task["role"]
        response = prefetch.invoke_role(
            task, role, specialist_messages(role, task["focus"]), context=run_context(runtime)
        )
        finding = Finding(
            role=role,
            text=str(response.text),
            cache_read=cache_read(response),
            pool_digest=response.response_metadata.get("pool_digest"),
        )
        return {"findings": [finding], "messages": [response]}

    def critic(state: State, runtime: Runtime[PolyKVContext]) -> dict[str, Any]:
        messages = critic_messages(state["findings"], state["roles"])
        response = prefetch.invoke_role(state, "critic", messages, context=run_context(runtime))
        return {"critique": str(response.text), "messages": [response]}

    def summarizer(state: State, runtime: Runtime[PolyKVContext]) -> dict[str, Any]:
        messages = summarizer_messages(state["findings"], state["roles"], state["critique"])
        response = prefetch.invoke_role(state, "summarizer", messages, context=run_context(runtime))
        return {"summary": str(response.text), "messages": [response]}

    builder = StateGraph(State, input_schema=InputState, context_schema=PolyKVContext)
    builder.add_node("check_input", check_input)
    builder.add_node("prefetch", prefetch)
    builder.add_node("planner", planner)
    builder.add_node("specialist", specialist)
    builder.add_node("critic", critic)
    builder.add_node("summarizer", summarizer)
    builder.add_edge(START, "check_input")
    builder.add_edge("check_input", "prefetch")
    builder.add_edge("prefetch", "planner")
    builder.add_conditional_edges("planner", assign_specialists, ["specialist"])
    builder.add_edge("specialist", "critic")
    builder.add_edge("critic", "summarizer")
    builder.add_edge("summarizer", END)
    return with_parallel_roles(builder.compile(checkpointer=checkpointer, name=name))


# For `langgraph dev` (langgraph.json): POLYKV_POOL_STORE names a pool directory, so threads resumed
# after a server restart reload their pool instead of prefilling the document again.
# POLYKV_RAY_ADDRESS sends the role calls to a Ray cluster (polykv_agents.graph.workflow.cluster_from_env).
graph = build_graph(store=os.environ.get("POLYKV_POOL_STORE") or None, cluster=cluster_from_env())
