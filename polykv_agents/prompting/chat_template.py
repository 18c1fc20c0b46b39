"""Turning documents and agent turns into text, so an agent's turns continue the pool's prefix.

A pool's prefix is either a plain document (raw text, the perplexity protocol) or chat messages
rendered with the model's chat template (typically a shared system message plus the document).
An agent then adds its own role prompt (a system message) and question (a user message) as
natural turns after that prefix, followed by the template's generation prompt.

The continuation is found by rendering prefix + new turns and cutting off the rendered prefix, so
any template that renders a conversation as a growing string works unchanged.

A conversation that ends with an assistant message that is not blank is continued rather than answered anew
(assistant prefill): the prompt ends inside that message, and the model writes the rest of it.

Tools (OpenAI function specs) can be handed to the template's own tool support. Templates write them at
the very top of a conversation, which a pooled call cannot change (the pool holds that prefix's KV), so
a continuation with tools is the call's turns rendered as a conversation of their own, with the tools,
less whatever the template writes at the start of every conversation (see :func:`render_continuation`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``, plus
``tool_calls`` on an assistant message and ``tool_call_id`` on a tool message (:mod:`polykv_agents.chat.messages`)."""

Tools = Sequence[Mapping[str, Any]] | None
"""OpenAI function specs for the template's own tool support, or ``None``."""


class ContinuationError(ValueError):
    """The chat template cannot render a call's turns as a continuation of the pool's prefix."""


class ToolsPlacementError(ContinuationError):
    """The chat template writes a call's tools somewhere a pooled call cannot put them (before the shared prefix)."""


DEFAULT_ROLE_PROMPT = "Answer the question using the document above. Be concise."


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _ends_with_partial_answer(messages: Sequence[Message]) -> bool:
    return bool(messages) and messages[-1]["role"] == "assistant" and bool(messages[-1]["content"].strip())


def _without_empty_final_answer(messages: Sequence[Message]) -> Sequence[Message]:
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"].strip():
        return messages[:-1]
    return messages


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], *, generation_prompt: bool, tools: Tools = None
) -> str:
    if generation_prompt:
        messages = _without_empty_final_answer(messages)
    prefill = generation_prompt and _ends_with_partial_answer(messages)
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=list(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=generation_prompt and not prefill,
        continue_final_message=prefill,
    )


def _fold_system_into_user(messages: Sequence[Message]) -> list[dict[str, str]]:
    """For templates that reject a system role (or one after the first turn): prepend each system
    message's text to the next user message instead."""
    folded: list[dict[str, str]] = []
    pending: list[str] = []
    for message in messages:
        if message["role"] == "system":
            pending.append(message["content"])
            continue
        content = message["content"]
        if pending and message["role"] == "user":
            content = "\n\n".join([*pending, content])
            pending = []
        folded.append({**message, "content": content})
    if pending:
        folded.append({"role": "user", "content": "\n\n".join(pending)})
    return folded


def render_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    generation_prompt: bool = False,
    tools: Tools = None,
) -> str:
    """Render a whole conversation, folding system messages into user turns if the template
    refuses them.

    Raises:
        jinja2.TemplateError: The template refuses the conversation even with its system messages folded (or it
            has none to fold). Any other error (a bad argument, a missing template) is raised as it comes.
    """
    try:
        return _render(tokenizer, messages, generation_prompt=generation_prompt, tools=tools)
    except TemplateError as e:  # raise_exception("System role not supported") in Gemma/Mistral-style templates
        if not any(message["role"] == "system" for message in messages):
            raise
        # Every render of such a template takes this way: info, not a warning per call.
        logger.info(
            "chat template refused these turns (%s: %s); rendering them again with each system message "
            "folded into the next user turn",
            type(e).__name__,
            e,
        )
        return _render(tokenizer, _fold_system_into_user(messages), generation_prompt=generation_prompt, tools=tools)


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], *, tools: Tools = None) -> str:
    """A whole conversation ending in the generation prompt, or inside its final assistant message
    (no pool in front of it). Tokenizers without a chat template get a plain ``User: ... / Assistant:`` format
    (and no tools: :mod:`polykv_agents.prompting.tool_prompts` shows them in the text instead)."""
    if has_chat_template(tokenizer):
        return render_messages(tokenizer, messages, generation_prompt=True, tools=tools)
    messages = _without_empty_final_answer(messages)
    turns = [m["content"] if m["role"] == "system" else f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(turns) + ("" if _ends_with_partial_answer(messages) else "\nAssistant:")


def render_continuation(
    tokenizer: PreTrainedTokenizerBase,
    prefix_messages: Sequence[Message] | None,
    new_messages: Sequence[Message],
    *,
    tools: Tools = None,
) -> str:
    """Text that continues a pool prefix with ``new_messages`` and the generation prompt.

    Args:
        prefix_messages: The chat messages the pool was built from, or ``None`` for a plain-text
            document pool.
        new_messages: The agent's turns (role prompt, question, ...).
        tools: Tools for the template's own tool support: ``new_messages`` are then rendered as a
            conversation of their own with the tools, less the template's conversation preamble.

    Raises:
        ContinuationError: The template renders the prefix differently once more turns follow.
        ToolsPlacementError: With ``tools``, the template writes them somewhere other than the call's own turns.
    """
    if prefix_messages is None or not has_chat_template(tokenizer):
        # A plain document: the agent's turns start a conversation right after it.
        return "\n\n" + render_prompt(tokenizer, new_messages, tools=tools)
    prefix_text = render_messages(tokenizer, prefix_messages)
    full_text = render_messages(tokenizer, [*prefix_messages, *new_messages], generation_prompt=True)
    if not full_text.startswith(prefix_text):
        msg = (
            "This chat template renders the pool's messages differently once more turns follow, so "
            "agent turns cannot continue the shared prefix. Build the pool from a plain-text document instead."
        )
        raise ContinuationError(msg)
    continuation = full_text[len(prefix_text) :]
    if not tools:
        return continuation
    # The call's turns alone = preamble + continuation; with tools = preamble + the same turns holding the tools.
    alone = render_messages(tokenizer, new_messages, generation_prompt=True)
    alone_with_tools = render_messages(tokenizer, new_messages, generation_prompt=True, tools=tools)
    preamble = alone[: len(alone) - len(continuation)]
    if not alone.endswith(continuation) or not alone_with_tools.startswith(preamble):
        msg = (
            "This chat template writes tools in front of the pool's shared prefix, not in the call's own turns; "
            "show the tools in a system message of the call instead (polykv_agents.prompting.tool_calls.tools_prompt)"
        )
        raise ToolsPlacementError(msg)
    return alone_with_tools[len(preamble) :]


def agent_turns(system_prompt: str | None, question: str) -> list[dict[str, str]]:
    """An agent's role prompt (as a system message) and its question."""
    return [
        {"role": "system", "content": system_prompt or DEFAULT_ROLE_PROMPT},
        {"role": "user", "content": question},
    ]
