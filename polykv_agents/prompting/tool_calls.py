"""Tool calling for ChatPolyKV: the call format, its grammar, and parsing calls back into ``tool_calls``.

The format is Hermes/Qwen style (the one Qwen- and Hermes-style chat templates ask for), one block
per call, several blocks for parallel calls:

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

Data flow of one call with tools bound:
  LangChain or OpenAI tools -> OpenAI function specs (langchain-core's converter)
  -> shown to the model (:mod:`polykv_agents.prompting.tool_prompts`: through the chat template's own tool support
     when it asks for this format, else the system message of :func:`tools_prompt`)
  -> :func:`tool_call_grammar` by ``tool_choice``: ``required`` (calls to any tool), a tool's name
     (calls to that one), ``auto`` (plain text that does not start with ``<``, or calls), ``none``
     (no grammar, no tools shown); one call only when ``parallel_tool_calls=False``
  -> decoded under that grammar -> :func:`parse_tool_calls` -> ``tool_calls`` with fresh ids (complete calls
     only: a call cut short by ``max_tokens`` is not returned).
Earlier calls in the conversation are rendered back in the same format (:func:`render_tool_calls`).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
from langchain_core.utils.function_calling import convert_to_openai_tool

from polykv_agents.sampling.grammar import GrammarError, closed_schema

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def format_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI function specs (``{"type": "function", "function": {name, description, parameters}}``)."""
    return [convert_to_openai_tool(tool) for tool in tools]


def normalize_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """``auto``, ``required``, ``none`` or a tool's name, from any of LangChain's spellings: ``None``
    (auto), ``"any"``/``True`` (required), a name, or ``{"type": "function", "function": {"name": ...}}``.

    Raises:
        ValueError: An unknown choice or tool name (the message lists the tools).
    """
    names = [spec["function"]["name"] for spec in tools]
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice in ("any", "required", True):
        return "required"
    if tool_choice == "none" or tool_choice is False:
        return "none"
    if isinstance(tool_choice, Mapping):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if isinstance(tool_choice, str) and tool_choice in names:
        return tool_choice
    msg = f"tool_choice must be 'auto', 'any', 'none' or one of the tools {names}, got {tool_choice!r}"
    raise ValueError(msg)


def _call_schema(spec: Mapping[str, Any]) -> dict[str, Any]:
    function = spec["function"]
    parameters = closed_schema(dict(function.get("parameters") or {"type": "object", "properties": {}}))
    parameters.setdefault("additionalProperties", False)
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], choice: str, *, parallel: bool = True) -> str | None:
    """The llguidance grammar for ``choice`` (see :func:`normalize_tool_choice`); ``None`` for ``none``.

    Args:
        tools: OpenAI function specs.
        choice: A normalized tool choice.
        parallel: Allow several calls in one answer (``parallel_tool_calls``); else exactly one.

    Raises:
        GrammarError: A tool's parameters cannot be compiled into a grammar.
    """
    if choice == "none":
        return None
    # Compiled once per distinct (tools, choice, parallel): bound models compile at bind time and on every call.
    return _compiled_tool_call_grammar(json.dumps(list(tools), sort_keys=True), choice, parallel)


@functools.lru_cache(maxsize=64)
def _compiled_tool_call_grammar(tools_json: str, choice: str, parallel: bool) -> str:
    tools = json.loads(tools_json)
    chosen = [spec for spec in tools if choice in ("auto", "required") or spec["function"]["name"] == choice]
    schemas = [_call_schema(spec) for spec in chosen]
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    # Written as json.dumps writes (and as render_tool_calls shows past calls), with no free whitespace:
    # a small model would otherwise spend its tokens on newlines and indentation. The one optional newline
    # on either side of the JSON is how chat templates of this format write a call.
    schema["x-guidance"] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    call = f'call: {json.dumps(CALL_OPEN)} "\\n"? %json {json.dumps(schema)} "\\n"? {json.dumps(CALL_CLOSE)}'
    calls = 'calls: call ("\\n"? call)*' if parallel else "calls: call"
    # auto: plain text may start with neither "<" nor whitespace, so the first token tells calls from an answer.
    start = "start: TEXT | calls\nTEXT: /[^<\\s](.|\\n)*/" if choice == "auto" else "start: calls"
    grammar = llguidance.LLMatcher.grammar_from_lark(f"{start}\n{calls}\n{call}\n")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        msg = f"the tools' parameters cannot be compiled into a grammar: {problem}"
        raise GrammarError(msg)
    return grammar


def tools_prompt(tools: Sequence[Mapping[str, Any]], choice: str, *, parallel: bool = True) -> str:
    """The system message that shows the model its tools and the call format (for chat templates without
    tool support of this format)."""
    listed = "\n".join(json.dumps(spec["function"], ensure_ascii=False) for spec in tools)
    if choice == "required":
        how = "Call one of them now"
    elif choice in ("auto", "none"):
        how = "When a tool helps, call it; otherwise answer directly"
    else:
        how = f"Call the tool {choice} now"
    example = f'{CALL_OPEN}{{"name": "<tool name>", "arguments": {{...}}}}{CALL_CLOSE}'
    several = " (one line per call, for several calls)" if parallel else ""
    return f"You can use these tools:\n{listed}\n{how}, by answering with exactly{several}:\n{example}"


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], str] | None:
    """The complete tool calls at the start of ``text`` as LangChain ``ToolCall`` s (each with a fresh id),
    and what follows them; ``None`` for plain text.

    Each call's JSON is read by a JSON decoder, so a ``</tool_call>`` inside an argument string is just
    text. Under the call grammar, what follows the complete calls is empty, or a call that ``max_tokens``
    cut short, even inside its opening tag (``<tool_c``).
    """
    rest = text.strip()
    if rest and CALL_OPEN.startswith(rest):  # cut inside the opening tag: no call yet, but not plain text
        return [], rest
    if not rest.startswith(CALL_OPEN):
        return None
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    while rest.startswith(CALL_OPEN):
        body = rest.removeprefix(CALL_OPEN).lstrip()
        try:
            call, end = decoder.raw_decode(body)
            after = body[end:].lstrip()
            complete = after.startswith(CALL_CLOSE) and isinstance(call, dict) and isinstance(call.get("name"), str)
        except json.JSONDecodeError:
            complete = False
        if not complete or "arguments" not in call:
            break
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        calls.append({"name": call["name"], "args": call["arguments"], "id": call_id, "type": "tool_call"})
        rest = after.removeprefix(CALL_CLOSE).lstrip()
    return calls, rest


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """Earlier tool calls (in chat-template form, ``{"function": {"name", "arguments"}}``) as the assistant
    wrote them, so the conversation reads as it happened."""
    blocks = []
    for call in tool_calls:
        written = {"name": call["function"]["name"], "arguments": call["function"].get("arguments", {})}
        blocks.append(f"{CALL_OPEN}{json.dumps(written, ensure_ascii=False)}{CALL_CLOSE}")
    return "\n".join(blocks)
