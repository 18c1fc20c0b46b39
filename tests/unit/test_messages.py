"""LangChain messages -> chat-template dicts."""

from __future__ import annotations

import pytest
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)

from polykv_agents.chat.messages import to_chat_messages


def test_each_message_type_gets_its_chat_role():
    converted = to_chat_messages(
        [
            SystemMessage("You are the critic."),
            HumanMessage("Check this."),
            AIMessage("Looks fine."),
            ToolMessage("42", tool_call_id="call-1"),
            ChatMessage(role="user", content="And now?"),
        ]
    )
    assert [m["role"] for m in converted] == ["system", "user", "assistant", "tool", "user"]
    assert converted[3]["content"] == "42"


def test_text_content_blocks_are_joined():
    message = HumanMessage(content=[{"type": "text", "text": "Hello, "}, "world"])
    assert to_chat_messages([message]) == [{"role": "user", "content": "Hello, world"}]


def test_non_text_content_is_a_clear_error():
    message = HumanMessage(content=[{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    with pytest.raises(ValueError, match="'image_url' content block; this chat model reads text only"):
        to_chat_messages([message])


@pytest.mark.parametrize("message", [FunctionMessage(content="x", name="f"), RemoveMessage(id="1")])
def test_message_types_without_a_chat_role_are_refused(message):
    with pytest.raises(TypeError, match="unsupported message type"):
        to_chat_messages([message])


def test_no_messages_is_refused():
    with pytest.raises(ValueError, match="at least one message"):
        to_chat_messages([])
