"""Tool calling for ChatPolyKV: tools in the prompt, a grammar for the call, ``AIMessage.tool_calls`` back.

The format (Hermes/Qwen style, which many instruct models have seen):

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

Data flow of one call with tools bound:
  LangChain or OpenAI tools -> OpenAI function specs (langchain-core's converter)
  -> :func:`tools_prompt`: a system message at the start of the call's own turns that lists them and
     shows the format. It is never put through the chat template's own ``tools`` support: templates
     render tools at the very top of the conversation, which would change the pool's shared prefix.
  -> :func:`tool_call_grammar` by ``tool_choice``: ``required`` (a call to any tool), a tool's name
     (a call to that one), ``auto`` (plain text that does not start with ``<``, or a call), ``none``
     (no grammar, no tools shown)
  -> decoded under that grammar -> :func:`parse_tool_call` -> ``tool_calls`` with fresh ids.
Earlier calls in the conversation (an ``AIMessage`` with ``tool_calls``) are rendered back in the same
format (:func:`render_tool_calls`); ``ToolMessage`` results are ``tool`` turns.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
from langchain_core.utils.function_calling import convert_to_openai_tool

from polykv_agents.grammar import GrammarError, closed_schema

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


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], choice: str) -> str | None:
    """The llguidance grammar for ``choice`` (see :func:`normalize_tool_choice`); ``None`` for ``none``.

    Raises:
        GrammarError: A tool's parameters cannot be compiled into a grammar.
    """
    if choice == "none":
        return None
    chosen = [spec for spec in tools if choice in ("auto", "required") or spec["function"]["name"] == choice]
    schemas = [_call_schema(spec) for spec in chosen]
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    # Written as json.dumps writes (and as render_tool_calls shows past calls), with no free whitespace:
    # a small model would otherwise spend its tokens on newlines and indentation.
    schema["x-guidance"] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    call = f"call: {json.dumps(CALL_OPEN)} %json {json.dumps(schema)} {json.dumps(CALL_CLOSE)}"
    # auto: plain text may start with neither "<" nor whitespace, so the first token tells a call from an answer.
    start = "start: TEXT | call\nTEXT: /[^<\\s](.|\\n)*/" if choice == "auto" else "start: call"
    grammar = llguidance.LLMatcher.grammar_from_lark(f"{start}\n{call}\n")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        msg = f"the tools' parameters cannot be compiled into a grammar: {problem}"
        raise GrammarError(msg)
    return grammar


def tools_prompt(tools: Sequence[Mapping[str, Any]], choice: str) -> str:
    """The system message that shows the model its tools and the call format."""
    listed = "\n".join(json.dumps(spec["function"], ensure_ascii=False) for spec in tools)
    how = (
        "Call one of them now"
        if choice == "required"
        else f"Call the tool {choice} now"
        if choice not in ("auto", "none")
        else "When a tool helps, call it; otherwise answer directly"
    )
    example = f'{CALL_OPEN}{{"name": "<tool name>", "arguments": {{...}}}}{CALL_CLOSE}'
    return f"You can use these tools:\n{listed}\n{how}, by answering with exactly:\n{example}"


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """The tool call in ``text`` as a LangChain ``ToolCall`` (with a fresh id), or ``None`` for plain text.

    Raises:
        ValueError: ``text`` starts a call that is not complete (the answer was cut by max_tokens).
    """
    stripped = text.strip()
    if not stripped.startswith(CALL_OPEN):
        return None
    body = stripped.removeprefix(CALL_OPEN).removesuffix(CALL_CLOSE)
    try:
        call = json.loads(body)
        return {
            "name": call["name"],
            "args": call["arguments"],
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "tool_call",
        }
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        msg = f"the tool call is not complete ({e}); if it was cut by max_tokens, raise max_tokens"
        raise ValueError(msg) from e


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """Earlier tool calls as the assistant wrote them, so the conversation reads as it happened."""
    return "".join(
        f"{CALL_OPEN}{json.dumps({'name': c['name'], 'arguments': c.get('args', {})}, ensure_ascii=False)}{CALL_CLOSE}"
        for c in tool_calls
    )
