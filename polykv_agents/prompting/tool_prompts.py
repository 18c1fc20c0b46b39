"""How a call's tools, and the tool calls and results earlier in its conversation, are shown to the model.

Two ways, chosen once per chat template (:func:`template_renders_tools`):

- **The template's own tool support**, when it asks for calls in the format this package decodes
  (Hermes ``<tool_call>`` blocks, the format Qwen- and Hermes-style templates use; the tests use a template
  of that form written for them, ``tests/tiny_models.HERMES_TOOLS_TEMPLATE``). The model
  then sees its tools, its earlier calls and their results in the words it was trained on. Over a pool,
  the tools go into the call's own first system turn, never in front of the shared prefix
  (:func:`polykv_agents.prompting.chat_template.render_continuation`).
- **The documented prompt format** otherwise (SmolLM2's template, which has no tool support; templates that
  ask for another call format, such as Llama 3.1's): :func:`polykv_agents.prompting.tool_calls.tools_prompt` as a system
  message at the start of the call's turns, earlier calls written into the assistant's text as
  ``<tool_call>{...}</tool_call>`` blocks, results as ``tool`` turns.

Data flow: chat-template turns (:func:`polykv_agents.chat.messages.to_chat_messages`) + the bound tools
-> :func:`prepare_turns` -> (turns to render, tools for the template or ``None``) -> the prompt renderers.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from polykv_agents.prompting.chat_template import (
    ContinuationError,
    Message,
    has_chat_template,
    render_continuation,
    render_messages,
)
from polykv_agents.prompting.tool_calls import CALL_OPEN, render_tool_calls

logger = logging.getLogger(__name__)

TOOLS_SYSTEM_PROMPT = "You can call tools."
"""The system turn a call's tools are written into when its own turns start without one (template tool support)."""


@dataclass(frozen=True)
class ToolsShown:
    """The tools one call shows the model."""

    specs: tuple[Mapping[str, Any], ...]
    """OpenAI function specs, for the template's own tool support."""
    prompt: str
    """The same tools in the documented prompt format (:func:`polykv_agents.prompting.tool_calls.tools_prompt`)."""


_PROBE_NAME = "polykv_probe_tool"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_PROBE_CALL = {"type": "function", "id": "call_probe", "function": {"name": _PROBE_NAME, "arguments": {}}}

# tokenizer -> (chat template, whether it renders tools in this package's format); templates can be reassigned.
_SUPPORT: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[str, bool]] = weakref.WeakKeyDictionary()
_SUPPORT_LOCK = threading.Lock()


def _probe(tokenizer: PreTrainedTokenizerBase) -> bool:
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}
    called = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    try:
        shown = render_messages(tokenizer, [system, user], generation_prompt=True, tools=[_PROBE_TOOL])
        replayed = render_messages(tokenizer, [user, called, {"role": "tool", "content": "r", "tool_call_id": "x"}])
        # And the tools can go into a pooled call's own turns (the template writes them into its first system turn):
        render_continuation(tokenizer, [system, user], [system, user], tools=[_PROBE_TOOL])
    except (TemplateError, ContinuationError) as e:  # the template refuses the probe, or puts tools before a prefix
        # Once per template (the answer is cached): the prompts of every call with tools depend on it.
        logger.info(
            "chat template cannot show tools in the <tool_call> format (%s: %s); calls with tools get them in "
            "the documented prompt format instead",
            type(e).__name__,
            e,
        )
        return False
    return all(CALL_OPEN in text and _PROBE_NAME in text for text in (shown, replayed))


def template_renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer``'s chat template shows tools and renders earlier calls in the ``<tool_call>`` format,
    with the tools in a call's own first system turn. Probed once per template (a few renders)."""
    if not has_chat_template(tokenizer):
        return False
    template = str(tokenizer.chat_template)
    with _SUPPORT_LOCK:
        known = _SUPPORT.get(tokenizer)
    if known is not None and known[0] == template:
        return known[1]
    supported = _probe(tokenizer)
    with _SUPPORT_LOCK:
        _SUPPORT[tokenizer] = (template, supported)
    return supported


def _with_calls_written_out(turn: Message) -> dict[str, Any]:
    """``turn`` as plain text: its tool calls written into the content, template-only keys dropped."""
    content = turn["content"]
    if turn.get("tool_calls"):
        content = "\n".join(part for part in (content, render_tool_calls(turn["tool_calls"])) if part)
    return {"role": turn["role"], "content": content}


def prepare_turns(
    tokenizer: PreTrainedTokenizerBase,
    turns: Sequence[Message],
    tools: ToolsShown | None,
    *,
    template_tools: bool | None = None,
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]] | None]:
    """The turns to render and the tools to hand the chat template (``None``: the tools, if any, are in the turns).

    Args:
        template_tools: Use the template's own tool support (default: where :func:`template_renders_tools`);
            ``False`` forces the documented prompt format.
    """
    if template_renders_tools(tokenizer) if template_tools is None else template_tools:
        if tools is None:
            return [dict(turn) for turn in turns], None
        if not turns or turns[0]["role"] != "system":  # the template writes tools into the first system turn
            turns = [{"role": "system", "content": TOOLS_SYSTEM_PROMPT}, *turns]
        return [dict(turn) for turn in turns], list(tools.specs)
    written = [_with_calls_written_out(turn) for turn in turns]
    if tools is not None:
        written.insert(0, {"role": "system", "content": tools.prompt})
    return written, None
