"""One call's prompt token ids: the call's own turns, shown after the pool's prefix (or alone).

messages (dicts, see :mod:`polykv_agents.chat.messages`) + tools to show
-> :func:`~polykv_agents.prompting.tool_prompts.prepare_turns` (the template's tool support, or the
   documented system message)
-> the chat template, as a continuation of the prefix's rendering (or as a whole prompt)
-> token ids ``[n]`` that the runtime feeds at positions ``T .. T+n-1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from polykv_agents.prompting.chat_template import (
    Message,
    Tools,
    ToolsPlacementError,
    render_continuation,
    render_prompt,
)
from polykv_agents.prompting.tool_prompts import ToolsShown, prepare_turns


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    prefix_messages: Sequence[Message] | None = None,
    tools: ToolsShown | None = None,
) -> torch.Tensor:
    """Token ids ``[n]`` of ``messages`` plus the generation prompt: as a continuation of
    ``prefix_messages`` (a pool's prefix, already in its cache) when given, else as a whole prompt.
    ``tools`` and earlier tool calls are shown as :mod:`polykv_agents.prompting.tool_prompts` decides
    for this tokenizer's chat template."""
    try:
        text = _render_call(tokenizer, *prepare_turns(tokenizer, messages, tools), prefix_messages=prefix_messages)
    except ToolsPlacementError:  # this conversation lines up unlike the template's probe: the documented format
        text = _render_call(
            tokenizer, *prepare_turns(tokenizer, messages, tools, template_tools=False), prefix_messages=prefix_messages
        )
    # The rendered template already holds its special tokens.
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


def _render_call(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    template_tools: Tools,
    *,
    prefix_messages: Sequence[Message] | None,
) -> str:
    if prefix_messages is not None:
        return render_continuation(tokenizer, prefix_messages, messages, tools=template_tools)
    return render_prompt(tokenizer, messages, tools=template_tools)
