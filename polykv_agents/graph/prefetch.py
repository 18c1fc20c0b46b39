"""The LangGraph prefetch node: build the document's pool once per workflow run, then hand roles a
chat model bound to it.

Graph state holds the document text and, after this node, the pool's handle as plain JSON (a
:class:`~polykv_agents.pool.handle.PoolHandleState`: digest, fingerprint, sizes, store location) — never
tensors and no custom type, so every checkpointer stores it as it is.

    prefetch = PrefetchDocument(ChatPolyKV(max_tokens=128), store="pools/")
    builder.add_node("prefetch", prefetch)          # state["document"] -> state["pool"]

    def critic(state):
        chat = prefetch.pooled_chat(state)           # ChatPolyKV bound to this run's pool
        return {"messages": [chat.invoke([SystemMessage(CRITIC), HumanMessage(...)])]}

A pool with the same digest already in the engine's registry (or in the store) is reused, not
rebuilt; a thread resumed in a fresh process reloads it from the store by digest, or rebuilds it
deterministically from the document in state if the file is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.config import CompressionConfig
from polykv_agents.engine import Engine
from polykv_agents.graph.context import PolyKVContext, run_context
from polykv_agents.graph.prefill_trace import traced_prefill
from polykv_agents.pool.handle import PoolHandle, PoolHandleState
from polykv_agents.pool.store import PoolStore

if TYPE_CHECKING:
    from polykv_agents.distributed import RayCluster

logger = logging.getLogger(__name__)

DEFAULT_SHARED_PROMPT = (
    "You are one of several specialists who all read the document below. Answer from the document; "
    "say so when it does not contain the answer."
)


class PrefetchDocument:
    """A LangGraph node (a callable ``state -> update``) that prefetches and compresses the document.

    Args:
        chat: The chat model the roles use; its ``model`` and ``device`` build the pool.
        config: Compression; ``None`` for the default.
        store: A directory (or :class:`PoolStore`) where pools are saved by digest, so that resumed
            threads find them in another process. ``None`` keeps pools in this process only.
        shared_prompt: The system message that precedes the document in the shared prefix.
        document_key: State key of the document text.
        pool_key: State key the pool handle is written to.
        engine: Where the pool is built and the role calls run (:class:`~polykv_agents.engine.Engine`);
            ``None``: ``chat``'s engine (the process-wide default unless ``chat`` names one).
        cluster: A :class:`polykv_agents.distributed.RayCluster`: the pool is built on one of its nodes and
            published to its object store, and every role call runs on its workers (the switch that sends
            a graph's role nodes to Ray). ``None``: everything runs in this process.
    """

    def __init__(
        self,
        chat: ChatPolyKV,
        *,
        config: CompressionConfig | None = None,
        store: PoolStore | str | Path | None = None,
        shared_prompt: str = DEFAULT_SHARED_PROMPT,
        document_key: str = "document",
        pool_key: str = "pool",
        engine: Engine | None = None,
        cluster: RayCluster | None = None,
    ) -> None:
        if engine is not None and chat.engine is not engine:
            chat = chat.model_copy(update={"engine": engine})
        if cluster is not None:
            from polykv_agents.distributed import RayChatPolyKV  # Ray is an optional extra

            chat = RayChatPolyKV.on(cluster, chat)
        self.cluster = cluster
        self.chat = chat
        self.config = config or CompressionConfig()
        self.store = store if isinstance(store, PoolStore) or store is None else PoolStore(store)
        self.shared_prompt = shared_prompt
        self.document_key = document_key
        self.pool_key = pool_key
        self.engine = chat.resolved_engine
        self.__name__ = "prefetch_document"  # LangGraph names a node after its callable

    def document_messages(self, state: Mapping[str, Any]) -> list[dict[str, str]]:
        """The shared prefix: the shared system prompt, then the document as a user turn."""
        document = state.get(self.document_key)
        if not isinstance(document, str) or not document.strip():
            msg = (
                f"state[{self.document_key!r}] must hold the document text before the prefetch node runs; "
                f"got {type(document).__name__}"
            )
            raise ValueError(msg)
        return [{"role": "system", "content": self.shared_prompt}, {"role": "user", "content": document}]

    def __call__(
        self,
        state: Mapping[str, Any],
        runtime: Any = None,
        # Spelled so that LangGraph recognises it under postponed annotations (it compares the annotation's text).
        config: Optional[RunnableConfig] = None,  # noqa: UP045
    ) -> dict[str, PoolHandleState]:
        """Build (or find) the pool of ``state``'s document. LangGraph passes the node its ``runtime``, whose
        :class:`~polykv_agents.graph.context.PolyKVContext` may name the run's model and compression preset, and its
        ``config``, whose callbacks trace the prefill as a chat-model run
        (:mod:`polykv_agents.graph.prefill_trace`)."""
        context = run_context(runtime)
        chat, compression = context.apply_to_chat(self.chat), context.apply_to_config(self.config)
        store_dir = None if self.store is None else self.store.directory  # get_or_build saves it there
        if self.cluster is not None:
            if context.model is not None or context.weights is not None:
                msg = (
                    "a Ray cluster serves the one model it was started with; leave model and weights out of the "
                    "run's context, or start a cluster (RayCluster(model=...)) for that model"
                )
                raise ValueError(msg)
            store = None if store_dir is None else str(store_dir.absolute())
            handle = self.cluster.prefetch(self.document_messages(state), config=compression, store_dir=store)
            return {self.pool_key: handle.to_state()}
        model, tokenizer = self.engine.load_model(
            chat.model, dtype=chat.dtype, device=chat.device, weights=chat.weights
        )
        document, pools = self.document_messages(state), self.engine.pools
        pool = traced_prefill(  # a chat-model run in the graph's trace: what the pool cost, once
            chat,
            document,
            config,
            lambda: pools.get_or_build(model, tokenizer, document, config=compression, store=self.store),
            resident=lambda: pools.digest_of(model, tokenizer, document, compression) in pools,
            origin=lambda built: pools.origin(built.digest),
        )
        if chat.runtime in ("auto", "decompressed"):
            # With the engine's compile_decode: compile the role calls' decode step here, once per model (later
            # runs skip it), so that no role call pays for it. Without it: nothing to do.
            self.engine.warm_up_decode(model, tokenizer, pool)
        return {self.pool_key: PoolHandle.from_pool(pool, store_dir=store_dir).to_state()}

    def pooled_chat(
        self, state: Mapping[str, Any], chat: ChatPolyKV | None = None, *, context: PolyKVContext | None = None
    ) -> Runnable:
        """``chat`` (default: this node's chat model, with the run's ``context`` settings) bound to the pool in
        ``state``.

        Raises:
            ValueError: The prefetch node has not run yet in this workflow (no handle in state).
        """
        return self._over_document(state, self._chat(chat, context), lambda bound: bound)

    def _chat(self, chat: ChatPolyKV | None, context: PolyKVContext | None) -> ChatPolyKV:
        """``chat`` (default: this node's) with a run's context settings, if any."""
        chat = chat or self.chat
        return chat if context is None else context.apply_to_chat(chat)

    def _over_document(
        self, state: Mapping[str, Any], chat: ChatPolyKV, finish: Callable[[ChatPolyKV], Runnable]
    ) -> Runnable:
        """``finish(chat bound to the pool in state)``: the one place a role's runnable is made, so that a
        baseline (:class:`benchmarks.studies.baselines.ReprefillDocument`) can replace how it reads the document."""
        return finish(self.pooled_model(state, chat))

    def pooled_model(
        self, state: Mapping[str, Any], chat: ChatPolyKV | None = None, *, context: PolyKVContext | None = None
    ) -> ChatPolyKV:
        """``chat`` (default: this node's chat model, with the run's ``context`` settings) bound to the pool in
        ``state``, as a chat model (what ``bind_tools`` and agent factories need).

        Raises:
            ValueError: The prefetch node has not run yet (no handle in state).
        """
        chat = self._chat(chat, context)
        handle = state.get(self.pool_key)
        if handle is None:
            msg = (
                f"state[{self.pool_key!r}] has no pool handle: a role node ran before the prefetch node. "
                "Add an edge from the prefetch node to every role node."
            )
            raise ValueError(msg)
        # Without the document, the registry or the store must still hold the pool.
        document = self.document_messages(state) if state.get(self.document_key) else None
        return chat.with_pool(handle, document=document)

    @staticmethod
    def _as_role(runnable: Runnable, role: str) -> Runnable:
        # Tagged role:<role> (metadata agent_role) so stream_mode="messages" can tell parallel branches apart.
        return runnable.with_config(metadata={"agent_role": role}, tags=[f"role:{role}"])

    def invoke_role(
        self,
        state: Mapping[str, Any],
        role: str,
        messages: Sequence[BaseMessage],
        *,
        context: PolyKVContext | None = None,
    ) -> AIMessage:
        """One role's call over the pool in ``state``, with the run's ``context`` settings: the reply is named
        after the role, and the call is tagged ``role:<role>`` (metadata ``agent_role``) so
        ``stream_mode="messages"`` can tell parallel branches of one node apart."""
        response = self._as_role(self.pooled_chat(state, context=context), role).invoke(list(messages))
        response.name = role
        return response

    def invoke_role_structured(
        self,
        state: Mapping[str, Any],
        role: str,
        messages: Sequence[BaseMessage],
        schema: Any,
        *,
        max_tokens: int | None = None,
        context: PolyKVContext | None = None,
    ) -> tuple[Any, AIMessage]:
        """One role's call over the pool in ``state`` that answers in ``schema`` (a pydantic model, TypedDict or
        JSON schema), decoded under its grammar: the parsed answer, and the raw reply named after the role.

        Args:
            max_tokens: This call's token budget (default: the chat model's, or the run's ``context``'s).
            context: The run's settings (model, runtime, ...).

        Raises:
            OutputParserException: The answer does not parse (it was cut by ``max_tokens``).
        """
        chat = self._chat(None, context)
        if max_tokens is not None:  # the node's own budget for this answer (a plan needs room to close)
            chat = chat.model_copy(update={"max_tokens": max_tokens})
        structured = self._over_document(
            state, chat, lambda bound: bound.with_structured_output(schema, include_raw=True)
        )
        result = self._as_role(structured, role).invoke(list(messages))
        result["raw"].name = role
        if result["parsing_error"] is not None:
            raise result["parsing_error"]
        return result["parsed"], result["raw"]
