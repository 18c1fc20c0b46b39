"""RayChatPolyKV: a ChatPolyKV whose calls run on a RayCluster's workers instead of in this process.

Everything a ChatPolyKV does on top of a call stays here, unchanged: ``bind_tools`` and
``with_structured_output`` bind their kwargs (tools, ``response_format``) here, parsers run here. Only the
call itself travels: (the chat model's settings, the messages, the call's kwargs, the pool handle, the
document) -> a worker on some node -> its AIMessage back. A worker dying mid-call is the cluster's
business (:meth:`RayCluster.invoke` sends the call elsewhere).

Streaming yields the whole answer as one chunk: the tokens are decoded on another machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk
from pydantic import Field, model_validator

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.distributed.cluster import RayCluster
from polykv_agents.pool.documents import Document
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.shared_pool import SharedKVPool

# The fields that say which pool to read: sent as the call's handle and document, not as settings.
_POOL_FIELDS = {"pool", "pool_document"}
# ChatPolyKV's own settings (model, max_tokens, temperature, ...): what a worker needs to make the same call.
# BaseChatModel's fields (callbacks, cache, rate limiter, ...) and the engine belong to this process and stay
# here: each worker runs on its own process's engine.
_LOCAL_FIELDS = {*BaseChatModel.model_fields, *_POOL_FIELDS, "engine"}
_SETTINGS = tuple(name for name in ChatPolyKV.model_fields if name not in _LOCAL_FIELDS)


class RayChatPolyKV(ChatPolyKV):
    """A ChatPolyKV that answers on a :class:`RayCluster` (build one with :meth:`on`)."""

    cluster: RayCluster = Field(exclude=True, repr=False)
    """The cluster the calls run on; its ``model`` and ``device`` are this chat model's."""

    @model_validator(mode="after")
    def _the_clusters_model(self) -> RayChatPolyKV:
        if (self.model, self.device) != (self.cluster.model, self.cluster.device):
            msg = (
                f"this chat model runs {self.model!r} on {self.device!r}, but the cluster's nodes load "
                f"{self.cluster.model!r} on {self.cluster.device!r} (and build pools with it); give both the same "
                "model and device"
            )
            raise ValueError(msg)
        return self

    @classmethod
    def on(cls, cluster: RayCluster, chat: ChatPolyKV | None = None) -> RayChatPolyKV:
        """``chat`` (default: a ChatPolyKV of the cluster's model), every setting kept, with its calls sent to
        ``cluster``. A pool object it was bound to is published to the cluster."""
        chat = chat or ChatPolyKV(model=cluster.model, device=cluster.device)
        fields = {name: getattr(chat, name) for name in type(chat).model_fields if name != "cluster"}
        remote = cls(**fields, cluster=cluster)
        if chat._pool_object is not None:
            remote = remote.with_pool(chat._pool_object, document=chat.pool_document)
        return remote

    def with_pool(
        self, pool: PoolHandle | SharedKVPool | Mapping[str, Any], *, document: Document | None = None
    ) -> RayChatPolyKV:
        """A copy that reads ``pool``; a pool object built in this process is published to the cluster first."""
        if isinstance(pool, SharedKVPool):
            pool = self.cluster.publish(pool)
        return self.model_copy(update={"pool": PoolHandle.model_validate(pool), "pool_document": document})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """The call, run on a worker, as one chunk (ChatPolyKV's ``_generate`` and async paths call this)."""
        kwargs.pop("ls_structured_output_format", None)  # tracing metadata, read here; it may hold a class
        settings = {name: getattr(self, name) for name in _SETTINGS}
        message = self.cluster.invoke(settings, messages, {**kwargs, "stop": stop}, self.pool, self.pool_document)
        tool_call_chunks = [
            {"name": call["name"], "args": json.dumps(call["args"]), "id": call["id"], "index": index}
            for index, call in enumerate(message.tool_calls)
        ]
        chunk = AIMessageChunk(
            content=message.content,
            tool_call_chunks=tool_call_chunks,
            usage_metadata=message.usage_metadata,
            response_metadata=message.response_metadata,
            chunk_position="last",
        )
        if run_manager is not None and message.text:
            run_manager.on_llm_new_token(message.text, chunk=ChatGenerationChunk(message=chunk))
        yield ChatGenerationChunk(
            message=chunk, generation_info={"finish_reason": message.response_metadata.get("finish_reason")}
        )
