"""ChatPolyKV: a LangChain chat model that answers from a shared, compressed document pool.

One call:
  LangChain messages -> chat-template turns that continue the pool's prefix (or a whole prompt,
  without a pool) -> a :class:`~polykv_agents.runtime.request.DecodeRequest` -> the engine's backend
  (:mod:`polykv_agents.runtime.generate`) -> text chunks, then one last chunk that carries usage
  metadata (``cache_read`` = tokens served from the pool) and response metadata.

Constructing a chat model loads nothing. The first call loads the model through its
:class:`~polykv_agents.engine.Engine` (``engine=``, else the process-wide default) and resolves the pool
handle through that engine's pool registry, so every role in a workflow shares one model and one pool.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from pydantic import Field, PrivateAttr

from polykv_agents.chat.async_bridge import iterate_in_thread
from polykv_agents.chat.messages import to_chat_messages
from polykv_agents.chat.structured_output import response_format_grammar, structured_output
from polykv_agents.engine import Engine, default_engine
from polykv_agents.model.dtype import DtypeName
from polykv_agents.model.loading import DEFAULT_MODEL
from polykv_agents.model.weights import Weights
from polykv_agents.pool.documents import Document
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.prompting.encode import encode_prompt
from polykv_agents.prompting.tool_calls import (
    CALL_OPEN,
    format_tools,
    normalize_tool_choice,
    parse_tool_calls,
    tool_call_grammar,
    tools_prompt,
)
from polykv_agents.prompting.tool_prompts import ToolsShown
from polykv_agents.runtime.backend import Runtime
from polykv_agents.runtime.generate import generate_text
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.sampling.settings import GenerationSettings, GenerationStats


@dataclass(frozen=True)
class _BoundTools:
    """What ``bind_tools`` put into a call's kwargs, ready for decoding."""

    shown: ToolsShown | None
    """The tools the model is shown (``None`` for ``tool_choice="none"``)."""
    grammar: str | None
    """The grammar of the call's answer (``None`` for ``tool_choice="none"``)."""
    free_text: bool = False
    """Whether the answer may be plain text instead of calls (``tool_choice="auto"``)."""
    names: tuple[str, ...] = ()

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], *, parallel_default: bool) -> _BoundTools | None:
        tools = kwargs.get("tools")
        if not tools:
            return None
        formatted = format_tools(tools)
        choice = normalize_tool_choice(kwargs.get("tool_choice"), formatted)
        if choice == "none":
            return cls(shown=None, grammar=None)
        parallel = bool(kwargs.get("parallel_tool_calls", parallel_default))
        return cls(
            shown=ToolsShown(tuple(formatted), tools_prompt(formatted, choice, parallel=parallel)),
            grammar=tool_call_grammar(formatted, choice, parallel=parallel),
            free_text=choice == "auto",
            names=tuple(spec["function"]["name"] for spec in formatted),
        )


def _tool_calls_chunk(
    text: str, finish_reason: str | None, names: tuple[str, ...]
) -> tuple[ChatGenerationChunk, str | None]:
    """The decoded calls as one tool-call chunk. A call that max_tokens cut short after complete ones is
    dropped (the finish reason stays ``length``); an answer without one complete call (or, defensively,
    one calling a tool that is not bound) stays text."""
    parsed = parse_tool_calls(text)
    calls, cut = parsed if parsed is not None else ([], "")
    if not calls or any(call["name"] not in names for call in calls):
        return ChatGenerationChunk(message=AIMessageChunk(content=text)), finish_reason
    call_chunks = [
        {"name": call["name"], "args": json.dumps(call["args"]), "id": call["id"], "index": index}
        for index, call in enumerate(calls)
    ]
    message = AIMessageChunk(content="", tool_call_chunks=call_chunks)
    return ChatGenerationChunk(message=message), finish_reason if cut else "tool_calls"


class ChatPolyKV(BaseChatModel):
    """Local Hugging Face chat model whose calls skip the document prefill by reading a SharedKVPool.

    Example:
        .. code-block:: python

            chat = ChatPolyKV(max_tokens=128)  # embedded SmolLM2-135M-Instruct, loads on first call
            critic = chat.with_pool(handle)  # handle: a PoolHandle from the prefetch node
            critic.invoke([SystemMessage("You are the critic."), HumanMessage("What is weakest?")])
    """

    model: str = DEFAULT_MODEL
    """The embedded model's name, a local model directory, or a hub id already in the local cache."""

    max_tokens: int = Field(default=256, ge=0)
    """Upper bound on generated tokens per call."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 decodes greedily (deterministic)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""

    seed: int | None = None
    """Sampling seed, for reproducible samples."""

    ignore_eos: bool = False
    """Decode exactly ``max_tokens``, past the end-of-sequence token (llama.cpp's and vLLM's ``ignore_eos``): for
    benchmarks that must compare equal work. A call under a grammar (tools, structured output) still ends where
    its grammar does."""

    stop: list[str] | None = None
    """Default stop sequences (multi-token strings allowed); a call's own ``stop`` replaces them."""

    pool: PoolHandle | None = None
    """The shared document pool calls read; ``None`` makes this a plain local chat model."""

    pool_document: Document | None = Field(default=None, exclude=True, repr=False)
    """The document the pool was built from: lets a pool that is neither in this process nor in its
    store be rebuilt (deterministically) instead of failing."""

    device: str = "cpu"
    """Where the model runs: ``cpu``, ``cuda``, ..."""

    dtype: DtypeName = "auto"
    """What the model computes in: ``auto`` is bf16 where the device has it natively (AVX-512 bf16 or AMX
    CPUs, CUDA), else fp32. A pool serves every dtype: it holds codes, not tensors of one dtype."""

    weights: Weights = "native"
    """How the model stores its weights: ``native`` (its dtype), or weight-only ``int8`` / ``int4`` on the CPU,
    which make decode steps faster (``polykv-agents bench weights``). The same pools serve every setting."""

    parallel_tool_calls: bool = False
    """Whether one answer may hold several tool calls; ``bind_tools(parallel_tool_calls=...)`` overrides it.
    Off by default, as in llama.cpp's server: small models allowed several calls tend to repeat the first."""

    runtime: Runtime = "decompressed"
    """How pooled calls read the pool: batched over one shared prefix kept ``decompressed`` (fast) or
    ``compressed`` (smallest), or ``private`` (one decoded copy per call, the reference design)."""

    engine: Engine | None = Field(default=None, exclude=True, repr=False)
    """Where models, pools and schedulers live (:class:`~polykv_agents.engine.Engine`); ``None``: the
    process-wide default engine."""

    _pool_object: SharedKVPool | None = PrivateAttr(default=None)
    """The pool given to :meth:`with_pool` as an object: held so the registry's budget cannot lose it."""

    @property
    def _llm_type(self) -> str:
        return "polykv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        # What changes the answers, so LangChain's response cache keeps them apart: the dtype and the weights too.
        return {
            "model": self.model,
            "dtype": self.dtype,
            "weights": self.weights,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "pool_digest": self.pool.digest if self.pool else None,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "polykv"
        params["ls_model_name"] = kwargs.get("model", self.model)
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def with_pool(
        self, pool: PoolHandle | SharedKVPool | Mapping[str, Any], *, document: Document | None = None
    ) -> ChatPolyKV:
        """A copy of this chat model that reads ``pool``.

        Args:
            pool: A handle (what LangGraph state holds) or a pool object, which is then put into the
                engine's pool registry.
            document: The pool's document, so the pool can be rebuilt if this process has never
                seen it and no store holds it (e.g. a checkpointed thread resumed elsewhere).
        """
        if not isinstance(pool, SharedKVPool):  # a handle, or its fields as a dict (a strict checkpoint serializer's)
            return self.model_copy(update={"pool": PoolHandle.model_validate(pool), "pool_document": document})
        self.resolved_engine.pools.put(pool)
        bound = self.model_copy(update={"pool": PoolHandle.from_pool(pool), "pool_document": document})
        bound._pool_object = pool  # the registry may evict it (byte budget); this copy still has it
        return bound

    # ---------------------------------------------------------------- one call

    def _settings(
        self, stop: list[str] | None, kwargs: dict[str, Any], tools: _BoundTools | None
    ) -> GenerationSettings:
        response_format = kwargs.get("response_format")
        if response_format is not None and tools is not None and tools.grammar is not None:
            msg = "pass either response_format or tools to one call, not both"
            raise ValueError(msg)
        grammar = tools.grammar if tools is not None else None
        if response_format is not None:
            grammar = response_format_grammar(response_format)
        return GenerationSettings(
            max_new_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            seed=kwargs.get("seed", self.seed),
            stop=stop if stop is not None else self.stop,
            grammar=grammar,
            ignore_eos=kwargs.get("ignore_eos", self.ignore_eos) and grammar is None,
            # tool_choice="auto": stop sequences still end a plain-text answer, never a call.
            structured_opening=CALL_OPEN if tools is not None and tools.free_text else None,
        )

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """This model with ``tools`` (LangChain tools, functions, pydantic models or OpenAI tool dicts).

        Tool calls are decoded under a grammar built from the tools' parameters, so they always parse,
        and come back as ``AIMessage.tool_calls`` with ids; see :mod:`polykv_agents.prompting.tool_calls`. The tools are
        shown through the chat template's own tool support where it has this call format, else in a
        documented system message (:mod:`polykv_agents.prompting.tool_prompts`).

        Args:
            tools: The tools.
            tool_choice: ``"auto"`` (default: answer or call), ``"any"``/``"required"`` (call),
                ``"none"`` (answer), or a tool's name (call that one).
            parallel_tool_calls: Whether an answer may hold several calls (default: the
                ``parallel_tool_calls`` field, off); otherwise it holds exactly one.

        Raises:
            ValueError: An unknown ``tool_choice``.
            GrammarError: A tool's parameters cannot be compiled (raised here, at bind time).
        """
        if not tools:
            return super().bind(**kwargs)
        formatted = format_tools(tools)
        choice = normalize_tool_choice(tool_choice, formatted)
        parallel = self.parallel_tool_calls if parallel_tool_calls is None else parallel_tool_calls
        tool_call_grammar(formatted, choice, parallel=parallel)  # check now: bad parameters fail at bind time
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(
        self, schema: Any = None, *, method: str = "json_schema", include_raw: bool = False, **kwargs: Any
    ) -> Runnable:
        """Answers as JSON following ``schema`` (a pydantic model, a TypedDict or a JSON schema), decoded
        under a grammar compiled from it, so the output always parses; see
        :mod:`polykv_agents.chat.structured_output`.

        Args:
            schema: The output schema; optional for ``method="json_mode"`` (any JSON object).
            method: ``json_schema`` (default) or ``json_mode``.
            include_raw: Return ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``.

        Raises:
            GrammarError: The schema cannot be compiled into a grammar (raised here, at bind time).
        """
        kwargs.pop("strict", None)  # always strict: the grammar enforces the schema
        if kwargs:
            msg = f"unsupported arguments {sorted(kwargs)}; with_structured_output takes schema, method, include_raw"
            raise ValueError(msg)
        return structured_output(self, schema, method=method, include_raw=include_raw)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        tools = _BoundTools.from_kwargs(kwargs, parallel_default=self.parallel_tool_calls)
        settings = self._settings(stop, kwargs, tools)
        model_name = kwargs.get("model", self.model)
        engine = self.resolved_engine
        model, tokenizer = engine.load_model(model_name, dtype=self.dtype, device=self.device, weights=self.weights)
        turns = to_chat_messages(messages)
        with contextlib.ExitStack() as lease:
            pool = None
            if self.pool is not None:
                # Leased for the whole call: the registry's byte budget never evicts a pool in use.
                pool = lease.enter_context(self._leased_pool(engine, model, tokenizer))
            prompt_ids = encode_prompt(
                tokenizer,
                turns,
                prefix_messages=pool.prefix_messages if pool else None,
                tools=tools.shown if tools else None,
            )
            request = DecodeRequest(model, tokenizer, prompt_ids, settings, pool=pool)
            stats = request.stats
            pieces = generate_text(request, engine.backend(self.runtime))
            # The first piece tells tool calls (sent whole, once complete) from text (streamed as it comes):
            # under tools, the grammar lets plain text start with anything but "<".
            call_text, first, calling = "", True, tools is not None and tools.grammar is not None
            for piece in pieces:
                if calling and (call_text or (first and piece.startswith("<"))):
                    call_text += piece
                    continue
                first = False
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager is not None:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
            finish_reason = stats.finish_reason
            if call_text:
                chunk, finish_reason = _tool_calls_chunk(call_text, finish_reason, tools.names)
                yield chunk
            yield self._final_chunk(stats, model_name, pool, finish_reason)

    @property
    def resolved_engine(self) -> Engine:
        """The engine calls run on: this model's ``engine``, else the process-wide default."""
        return self.engine if self.engine is not None else default_engine()

    def _leased_pool(self, engine: Engine, model, tokenizer) -> contextlib.AbstractContextManager[SharedKVPool]:
        """This call's pool, leased from the engine's registry (so its budget never evicts it mid-call)."""
        held = self._pool_object
        if held is not None and self.pool is not None and held.digest == self.pool.digest:
            held.check_compatible(model, tokenizer)
            return engine.pools.leased(held)
        assert self.pool is not None
        return engine.pools.use(self.pool, model, tokenizer, document=self.pool_document)

    @staticmethod
    def _final_chunk(
        stats: GenerationStats, model_name: str, pool: SharedKVPool | None, finish_reason: str | None
    ) -> ChatGenerationChunk:
        """The one chunk that carries usage and response metadata."""
        usage = UsageMetadata(
            input_tokens=stats.cached_tokens + stats.prompt_tokens,
            output_tokens=stats.output_tokens,
            total_tokens=stats.cached_tokens + stats.prompt_tokens + stats.output_tokens,
            input_token_details={"cache_read": stats.cached_tokens},
        )
        metadata = {
            "model_name": model_name,
            "finish_reason": finish_reason,
            "pool_digest": pool.digest if pool is not None else None,
        }
        message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish_reason})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop=stop, **kwargs))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # Decoding runs on a worker thread; the event loop only awaits chunks.
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop=stop, **kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop=stop, **kwargs))
