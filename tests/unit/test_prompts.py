"""Rendering agent turns as a continuation of the pool's prefix."""

from __future__ import annotations

import copy

import pytest

from polykv_agents.prompting.chat_template import agent_turns, render_continuation, render_messages

# A template in the style of Gemma/Mistral: no system role, strict user/assistant alternation.
NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<turn>' + message['role'] + '\n' + message['content'] + '<end>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<turn>model\n' }}{% endif %}"
)


@pytest.fixture
def no_system_tok(tiny_tok):
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = NO_SYSTEM_TEMPLATE
    return tok


def test_continuation_plus_prefix_equals_the_whole_conversation(tiny_tok):
    prefix = [{"role": "system", "content": "Shared."}, {"role": "user", "content": "The document."}]
    turns = agent_turns("You are the critic.", "Is it sound?")
    continuation = render_continuation(tiny_tok, prefix, turns)
    whole = render_messages(tiny_tok, [*prefix, *turns], generation_prompt=True)
    assert render_messages(tiny_tok, prefix) + continuation == whole
    assert continuation.startswith("<|im_start|>system\nYou are the critic.")
    assert continuation.endswith("<|im_start|>assistant\n")


def test_templates_without_a_system_role_get_it_folded_into_the_user_turn(no_system_tok):
    text = render_messages(no_system_tok, agent_turns("You are the critic.", "Is it sound?"), generation_prompt=True)
    assert text == "<turn>user\nYou are the critic.\n\nIs it sound?<end>\n<turn>model\n"


def test_plain_document_pool_starts_a_conversation_after_the_text(tiny_tok):
    continuation = render_continuation(tiny_tok, None, agent_turns(None, "Why?"))
    assert continuation.startswith("\n\n<|im_start|>system\n")
    assert continuation.endswith("<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizers_without_a_chat_template_get_a_plain_format(tiny_tok):
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = None
    assert render_continuation(tok, None, agent_turns("Be brief.", "Why?")) == "\n\nBe brief.\nUser: Why?\nAssistant:"
