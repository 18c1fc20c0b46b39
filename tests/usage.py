"""What a chat answer says it read: the pool's tokens and those reused from earlier calls (the prefix tree)."""

from __future__ import annotations

from langchain_core.messages import AIMessage


def reused(message: AIMessage) -> int:
    """Tokens of the call's own prompt read from earlier calls' keys and values instead of prefilled."""
    return message.response_metadata["reused_tokens"]


def pool_read(message: AIMessage) -> int:
    """Tokens read from the pool: ``cache_read`` without the reused ones."""
    return message.usage_metadata["input_token_details"]["cache_read"] - reused(message)
