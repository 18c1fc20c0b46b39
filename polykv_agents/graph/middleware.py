"""Agent middleware for LangChain's ``create_agent`` (the current form of LangGraph's ``create_react_agent``):
every model call of an agent reads its document from one shared, compressed pool.

Data flow of one agent run:
  [messages, document] -> ``before_agent``: the document is prefilled and compressed once (or the pool it
      already has is found in the registry or the store) -> [pool] (a PoolHandle as plain JSON, never tensors)
  -> model <-> tools loop: ``wrap_model_call`` binds each model call to that pool, so no step prefills the
      document again (``cache_read`` = the pool's tokens on every step)

    agent = create_agent(
        ChatPolyKV(max_tokens=128),
        tools=[search_document],
        middleware=[DocumentPoolMiddleware(ChatPolyKV(max_tokens=128)), ModelCallLimitMiddleware(run_limit=4)],
    )
    agent.invoke({"messages": [HumanMessage("What did leakage cost?")], "document": text})

:class:`ToolFirstMiddleware` makes the model call a tool until a tool has answered: small models asked
with ``tool_choice="auto"`` tend to answer from memory instead of looking the document up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
from langchain_core.messages import HumanMessage, ToolMessage
from langgraph.runtime import Runtime
from typing_extensions import NotRequired

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.config import CompressionConfig
from polykv_agents.graph.context import run_context
from polykv_agents.graph.prefetch import PrefetchDocument
from polykv_agents.pool.handle import PoolHandleState
from polykv_agents.pool.store import PoolStore


class DocumentAgentState(AgentState):
    """An agent's state with the document it works over and, once prefetched, the handle of its pool."""

    document: str
    """The document text (prefilled once into the pool)."""
    pool: NotRequired[PoolHandleState | None]
    """Written by :class:`DocumentPoolMiddleware` before the first model call."""


ModelHandler = Callable[[ModelRequest], ModelResponse]


class DocumentPoolMiddleware(AgentMiddleware):
    """Prefetches the run's ``document`` into a pool and binds every model call of the agent to it.

    Args:
        chat: A chat model like the agent's (its ``model`` and ``device`` build the pool, before the first
            model call); each call runs on the agent's own ChatPolyKV, bound to the pool.
        config: Compression; ``None`` for the default.
        store: A directory (or :class:`PoolStore`) where pools are saved by digest, so a thread resumed in
            another process reloads its pool instead of prefilling the document again.
    """

    state_schema = DocumentAgentState

    def __init__(
        self,
        chat: ChatPolyKV,
        *,
        config: CompressionConfig | None = None,
        store: PoolStore | str | Path | None = None,
    ) -> None:
        super().__init__()
        self.prefetch = PrefetchDocument(chat, config=config, store=store)

    def before_agent(self, state: DocumentAgentState, runtime: Runtime) -> dict[str, Any] | None:
        return self.prefetch(state, runtime)  # finds the pool in the registry or the store when it was built before

    async def abefore_agent(self, state: DocumentAgentState, runtime: Runtime) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.prefetch, state, runtime)  # a prefill must not block the event loop

    def _pooled(self, request: ModelRequest) -> ModelRequest:
        if not isinstance(request.model, ChatPolyKV):
            msg = (
                "DocumentPoolMiddleware binds a ChatPolyKV to the pool, but the agent's model is "
                f"{type(request.model).__name__}; create the agent with a ChatPolyKV"
            )
            raise TypeError(msg)
        # The run's context (an agent created with context_schema=PolyKVContext) may set the model, max_tokens, ...
        context = run_context(request.runtime)
        return request.override(model=self.prefetch.pooled_model(request.state, request.model, context=context))

    def wrap_model_call(self, request: ModelRequest, handler: ModelHandler) -> ModelResponse:
        return handler(self._pooled(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> ModelResponse:
        return await handler(self._pooled(request))


class ToolFirstMiddleware(AgentMiddleware):
    """Until a tool has answered since the user's last message, the model must call a tool
    (``tool_choice="any"``); afterwards it chooses. The usual "retrieve first" policy of agents over a document."""

    @staticmethod
    def _choice(request: ModelRequest) -> ModelRequest:
        since_user = []
        for message in reversed(request.messages):
            if isinstance(message, HumanMessage):
                break
            since_user.append(message)
        if any(isinstance(message, ToolMessage) for message in since_user):
            return request
        return request.override(tool_choice="any")

    def wrap_model_call(self, request: ModelRequest, handler: ModelHandler) -> ModelResponse:
        return handler(self._choice(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> ModelResponse:
        return await handler(self._choice(request))
