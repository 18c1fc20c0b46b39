"""Rendering agent turns as a continuation of the pool's prefix."""

from __future__ import annotations

import copy
import logging

import pytest
from jinja2 import TemplateError

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


def test_templates_without_a_system_role_get_it_folded_into_the_user_turn_and_it_is_logged(no_system_tok, caplog):
    with caplog.at_level(logging.INFO, logger="polykv_agents.prompting.chat_template"):
        text = render_messages(
            no_system_tok, agent_turns("You are the critic.", "Is it sound?"), generation_prompt=True
        )
    assert text == "<turn>user\nYou are the critic.\n\nIs it sound?<end>\n<turn>model\n"
    (record,) = caplog.records
    assert "folded into the next user turn" in record.getMessage()
    assert "System role not supported" in record.getMessage()  # why: the template's own words


def test_a_template_error_without_system_turns_to_fold_is_raised(no_system_tok):
    refusing = copy.deepcopy(no_system_tok)
    refusing.chat_template = "{{ raise_exception('No conversations here') }}"
    with pytest.raises(TemplateError, match="No conversations here"):
        render_messages(refusing, [{"role": "user", "content": "Hi."}])


def test_errors_that_are_not_the_template_s_refusal_are_not_taken_for_one(tiny_tok, caplog):
    """A bug (here a TypeError where system turns are rendered) propagates: it never silently folds the turns."""
    tok = copy.deepcopy(tiny_tok)
    render = tok.apply_chat_template

    def buggy(messages, **kwargs):
        if any(m["role"] == "system" for m in messages):
            raise TypeError("unsupported operand type(s)")
        return render(messages, **kwargs)

    tok.apply_chat_template = buggy
    with caplog.at_level(logging.INFO), pytest.raises(TypeError, match="unsupported operand"):
        render_messages(tok, agent_turns("You are the critic.", "Is it sound?"), generation_prompt=True)
    assert not caplog.records


def test_plain_document_pool_starts_a_conversation_after_the_text(tiny_tok):
    continuation = render_continuation(tiny_tok, None, agent_turns(None, "Why?"))
    assert continuation.startswith("\n\n<|im_start|>system\n")
    assert continuation.endswith("<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizers_without_a_chat_template_get_a_plain_format(tiny_tok):
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = None
    assert render_continuation(tok, None, agent_turns("Be brief.", "Why?")) == "\n\nBe brief.\nUser: Why?\nAssistant:"
