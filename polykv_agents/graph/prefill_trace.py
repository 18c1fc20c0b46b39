"""The prefetch node's document prefill as a traced chat-model run.

Tracing (LangSmith, or any LangChain callback handler) then shows the pool's cost once, next to the role
calls that read it: a run named :data:`PREFILL_RUN_NAME` whose output carries usage as LangChain reports
prompt caching, ``input_token_details={"cache_creation": T}`` when this run prefilled the document's ``T``
tokens, ``{"cache_read": T}`` when the pool was already in the engine or in the store. Every later role call
reports ``cache_read = T`` too, so a trace adds up what the pool cost and what it saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManager
from langchain_core.messages import AIMessage, convert_to_messages
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import ensure_config
from langgraph.constants import TAG_NOSTREAM

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.pool.shared_pool import SharedKVPool

PREFILL_RUN_NAME = "polykv_prefill_document"
"""The name of the traced run of a prefetch node's document prefill."""


def prefill_usage(pool: SharedKVPool, source: str) -> UsageMetadata:
    """The run's usage: the document's tokens, written into the cache (``built``) or read from it (otherwise)."""
    tokens = pool.num_tokens
    detail = "cache_creation" if source == "built" else "cache_read"
    return UsageMetadata(
        input_tokens=tokens, output_tokens=0, total_tokens=tokens, input_token_details={detail: tokens}
    )


def traced_prefill(
    chat: ChatPolyKV,
    document: Sequence[dict[str, str]],
    config: RunnableConfig | None,
    build: Callable[[], SharedKVPool],
    *,
    resident: Callable[[], bool],
    origin: Callable[[SharedKVPool], str | None],
) -> SharedKVPool:
    """``build()`` inside a chat-model run of ``config``'s callbacks (a graph node's config; ``None``: the current
    runnable context's); without callbacks it only builds. ``resident()``, asked before the build, says whether
    the pool was in the engine already; ``origin(pool)`` says how the engine got it (``built`` or ``store``)."""
    config = ensure_config(config)
    manager = CallbackManager.configure(
        config.get("callbacks"),
        inheritable_tags=config.get("tags"),
        inheritable_metadata=config.get("metadata"),
        # Traced, not streamed: stream_mode="messages" shows what roles say, and a prefill says nothing.
        local_tags=[TAG_NOSTREAM],
        local_metadata={**chat._get_ls_params(), "ls_max_tokens": 0},  # LangSmith's model fields
    )
    if not manager.handlers:
        return build()
    (run,) = manager.on_chat_model_start(
        {"name": PREFILL_RUN_NAME, "id": ["polykv_agents", "graph", "PrefetchDocument"]},
        [convert_to_messages(list(document))],
        invocation_params={"model": chat.model, "_type": "polykv-prefill"},
        name=PREFILL_RUN_NAME,
    )
    started = time.perf_counter()
    try:
        was_resident = resident()
        pool = build()
    except BaseException as e:
        run.on_llm_error(e)
        raise
    source = "registry" if was_resident else (origin(pool) or "built")
    metadata: dict[str, Any] = {
        "model_provider": "polykv",
        "model_name": chat.model,
        "pool_digest": pool.digest,
        "pool_source": source,
        "pool_nbytes": pool.nbytes,
        "prefill_s": time.perf_counter() - started,
    }
    message = AIMessage(content="", usage_metadata=prefill_usage(pool, source), response_metadata=metadata)
    run.on_llm_end(LLMResult(generations=[[ChatGeneration(message=message)]]))
    return pool
