"""LangChain messages -> the ``{"role", "content"}`` dicts that chat templates render.

System, human, AI and tool messages map to the ``system``, ``user``, ``assistant`` and ``tool``
roles; a ``ChatMessage`` keeps its own role. An ``AIMessage``'s tool calls are kept in the form chat
templates with tool support read (``tool_calls: [{"type": "function", "id", "function": {"name",
"arguments"}}]``), a ``ToolMessage``'s call id as ``tool_call_id``: :mod:`polykv_agents.prompting.tool_prompts`
then lets the template render them, or writes them into the text for templates that cannot. Only text
content is supported: content blocks of other kinds, and message types that have no chat-template
role, raise a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

_ROLES: tuple[tuple[type[BaseMessage], str], ...] = (
    (SystemMessage, "system"),
    (HumanMessage, "user"),
    (AIMessage, "assistant"),
    (ToolMessage, "tool"),
)


_TOOL_CALL_BLOCKS = ("tool_use", "tool_call", "function_call")


def _text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") in _TOOL_CALL_BLOCKS:
            continue  # a provider's copy of a tool call: rendered from message.tool_calls instead
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            msg = f"{type(message).__name__} has a {kind!r} content block; this chat model reads text only"
            raise ValueError(msg)
    return "".join(parts)


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Convert LangChain messages for :func:`polykv_agents.prompting.chat_template.render_messages`.

    Raises:
        TypeError: A message type with no chat role (e.g. ``FunctionMessage``, ``RemoveMessage``).
        ValueError: Non-text content, no messages at all, or a conversation that ends with tool calls
            whose results are missing.
    """
    if not messages:
        msg = "no messages to answer; pass at least one message"
        raise ValueError(msg)
    final = messages[-1]
    if isinstance(final, AIMessage) and final.tool_calls:
        msg = (
            "the conversation ends with an AIMessage that calls tools, without their results; add a ToolMessage "
            "(with the call's tool_call_id) for each call before asking for the next answer"
        )
        raise ValueError(msg)
    converted = []
    for message in messages:
        if isinstance(message, ChatMessage):
            role = message.role
        else:
            role = next((name for cls, name in _ROLES if isinstance(message, cls)), None)
        if role is None:
            msg = (
                f"unsupported message type {type(message).__name__}; use SystemMessage, HumanMessage, "
                "AIMessage, ToolMessage or ChatMessage"
            )
            raise TypeError(msg)
        turn: dict[str, Any] = {"role": role, "content": _text(message)}
        if isinstance(message, AIMessage) and message.tool_calls:
            turn["tool_calls"] = [
                {"type": "function", "id": call["id"], "function": {"name": call["name"], "arguments": call["args"]}}
                for call in message.tool_calls
            ]
        if isinstance(message, ToolMessage):
            turn["tool_call_id"] = message.tool_call_id
            if message.name:
                turn["name"] = message.name
        converted.append(turn)
    return converted
