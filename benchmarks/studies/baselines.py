"""Baselines that benchmarks compare the pooled path with. They live here, not in the product classes.

:class:`ReprefillDocument` is the prefetch node of a workflow without a pool: it builds nothing, and every
role call puts the whole document in front of its own messages and prefills it again, as a plain local
chat model does. Graphs take it in place of a :class:`~polykv_agents.graph.prefetch.PrefetchDocument`
(``build_graph(prefetch=ReprefillDocument(chat))``), so both sides run the same nodes and prompts.

It has neither prefix reuse nor batching: every call prefills its whole prompt, and decodes alone. With a
:class:`ReprefillEngine` (``ChatPolyKV(engine=ReprefillEngine())``, as ``benchmarks/studies/graph_e2e.py``
builds it), that prefill is the pool's chunked prefill (:func:`~polykv_agents.pool.prefill.prefill_cache`),
the one the time-to-first-token baseline (:func:`~polykv_agents.bench.ttft.ttft_reprefill`) times; with any
other engine it is the private runtime's single forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, convert_to_messages
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableLambda

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.engine import Engine
from polykv_agents.graph.context import PolyKVContext
from polykv_agents.graph.prefetch import PrefetchDocument
from polykv_agents.pool.handle import PoolHandleState
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.runtime.backend import Backend, Runtime
from polykv_agents.runtime.private import private_tokens
from polykv_agents.runtime.request import DecodeRequest


def _as_messages(value: Any) -> list[BaseMessage]:
    """A chat model's input (a string, a prompt value or message-likes) as messages."""
    if isinstance(value, str):
        return [HumanMessage(value)]
    if isinstance(value, PromptValue):
        return value.to_messages()
    return convert_to_messages(value)


class ChunkedPrefillBackend:
    """Calls without a pool, each alone: its whole prompt prefilled by the pool's chunked prefill
    (:func:`~polykv_agents.pool.prefill.prefill_cache`, ``[chunk, T]`` attention scores per forward), then
    decoded over that cache by the private runtime."""

    name = "private"

    def decode(self, request: DecodeRequest, budget: int) -> Iterator[int]:
        if request.pool is not None:
            msg = "the re-prefill baseline's backend serves calls without a pool; this call reads one"
            raise ValueError(msg)
        return private_tokens(request, budget, prefill=prefill_cache)


class ReprefillEngine(Engine):
    """An engine for the no-pool baseline: every runtime name is :class:`ChunkedPrefillBackend`, so every
    call prefills its prompt, the document in front, as the time-to-first-token baseline does."""

    def backend(self, runtime: Runtime) -> Backend:
        super().backend(runtime)  # the same check of the name
        return ChunkedPrefillBackend()


class ReprefillDocument(PrefetchDocument):
    """The no-pool baseline: same state, prompts and role calls as :class:`PrefetchDocument`, but the document
    is prefilled again by every call. Takes the same arguments (``cluster`` excepted)."""

    def __init__(self, chat: ChatPolyKV, **kwargs: Any) -> None:
        if kwargs.get("cluster") is not None:
            msg = "the no-pool baseline cannot run on a cluster; pass cluster=None"
            raise ValueError(msg)
        super().__init__(chat, **kwargs)

    def __call__(self, state: Mapping[str, Any], runtime: Any = None) -> dict[str, PoolHandleState | None]:
        self.document_messages(state)  # the same input check as with a pool
        return {self.pool_key: None}

    def _over_document(
        self, state: Mapping[str, Any], chat: ChatPolyKV, finish: Callable[[ChatPolyKV], Runnable]
    ) -> Runnable:
        prefix = convert_to_messages(self.document_messages(state))
        return RunnableLambda(lambda value: [*prefix, *_as_messages(value)]) | finish(chat)

    def pooled_model(
        self, state: Mapping[str, Any], chat: ChatPolyKV | None = None, *, context: PolyKVContext | None = None
    ) -> ChatPolyKV:
        msg = "the no-pool baseline has no pooled model; use pooled_chat, which puts the document in front"
        raise ValueError(msg)


def pinned_schema(schema: dict[str, Any], answer: Mapping[str, str]) -> dict[str, Any]:
    """``schema`` (an object of string properties) with every property's value fixed to ``answer``'s (``const``):
    decoded under it, any model writes the same JSON, token for token's worth of work."""
    pinned = copy.deepcopy(schema)
    pinned["properties"] = {name: {"type": "string", "const": answer[name]} for name in schema["properties"]}
    return pinned


class PinnedPlan:
    """Mixed into a prefetch node so that the ``planner`` role's structured answer is fixed to ``plan(roles)``:
    every method compared then decodes the same plan (a compressed and a full-precision document lead a
    greedy model to different plans of different lengths), and the specialists get the same focuses."""

    def __init__(self, *args: Any, plan: Callable[[Sequence[str]], dict[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan = plan

    def invoke_role_structured(
        self, state: Mapping[str, Any], role: str, messages: Sequence[BaseMessage], schema: Any, **kwargs: Any
    ) -> tuple[Any, AIMessage]:
        if role == "planner":
            schema = pinned_schema(schema, self._plan(list(schema["properties"])))
        return super().invoke_role_structured(state, role, messages, schema, **kwargs)  # type: ignore[misc]


class PinnedPlanPrefetch(PinnedPlan, PrefetchDocument):
    """The pooled prefetch node, its plan pinned."""


class PinnedPlanReprefill(PinnedPlan, ReprefillDocument):
    """The no-pool baseline, its plan pinned."""
