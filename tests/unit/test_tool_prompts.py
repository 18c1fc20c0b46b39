"""Tools shown through the chat template's own tool support where it has the <tool_call> format (over a pool:
in the call's own turns, the shared prefix untouched), the documented prompt format everywhere else."""

from __future__ import annotations

import copy
import logging

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel, Field
from tiny_models import CHATML_TEMPLATE, HERMES_TOOLS_TEMPLATE, tiny_hermes_tokenizer, tiny_llama
from usage import pool_read

from polykv_agents import SharedKVPool
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.chat.messages import to_chat_messages
from polykv_agents.prompting.chat_template import render_messages
from polykv_agents.prompting.encode import encode_prompt
from polykv_agents.prompting.tool_calls import format_tools, tools_prompt
from polykv_agents.prompting.tool_prompts import TOOLS_SYSTEM_PROMPT, ToolsShown, prepare_turns, template_renders_tools


class Add(BaseModel):
    """Add two digits."""

    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


SPECS = format_tools([Add])
SHOWN = ToolsShown(tuple(SPECS), tools_prompt(SPECS, "auto"))
PREFIX = [{"role": "system", "content": "Shared."}, {"role": "user", "content": "The register lists three risks."}]
HISTORY = [
    SystemMessage("You are the analyst."),
    HumanMessage("Add 2 and 3."),
    AIMessage("", tool_calls=[{"name": "Add", "args": {"a": 2, "b": 3}, "id": "call_1", "type": "tool_call"}]),
    ToolMessage("5", tool_call_id="call_1"),
]

# Lists tools, but asks for calls in another format (as Llama 3.1's or Mistral's templates do).
OTHER_FORMAT_TEMPLATE = (
    "{% if tools %}{{ '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{% endif %}" + CHATML_TEMPLATE
)


@pytest.fixture(scope="module")
def hermes():
    return tiny_hermes_tokenizer()


def test_only_templates_with_the_tool_call_format_count_as_tool_support(hermes, tiny_tok):
    assert template_renders_tools(hermes)
    assert not template_renders_tools(tiny_tok)  # ChatML without tools, as SmolLM2's template
    other = copy.deepcopy(tiny_tok)
    other.chat_template = OTHER_FORMAT_TEMPLATE
    assert not template_renders_tools(other)
    other.chat_template = None
    assert not template_renders_tools(other)


def test_a_reassigned_template_is_probed_again(hermes):
    tokenizer = copy.deepcopy(hermes)
    assert template_renders_tools(tokenizer)
    tokenizer.chat_template = CHATML_TEMPLATE
    assert not template_renders_tools(tokenizer)


def test_a_template_that_refuses_the_probe_has_no_tool_support_and_says_why(hermes, caplog):
    """Mistral-style templates raise on tool call ids they do not accept: the documented format, and a log record."""
    tokenizer = copy.deepcopy(hermes)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('Tool call ids must be 9 long') }}"
        "{% endif %}{% endfor %}" + HERMES_TOOLS_TEMPLATE
    )
    with caplog.at_level(logging.INFO, logger="polykv_agents.prompting.tool_prompts"):
        assert not template_renders_tools(tokenizer)
    (record,) = caplog.records
    assert "documented prompt format" in record.getMessage()
    assert "TemplateError: Tool call ids must be 9 long" in record.getMessage()


def test_a_bug_while_probing_propagates_instead_of_meaning_no_tool_support(hermes):
    tokenizer = copy.deepcopy(hermes)

    def buggy(*args, **kwargs):
        raise TypeError("apply_chat_template() got an unexpected keyword argument")

    tokenizer.apply_chat_template = buggy
    with pytest.raises(TypeError, match="unexpected keyword"):
        template_renders_tools(tokenizer)


def pooled_text(tokenizer, pool_messages, history, tools) -> str:
    ids = encode_prompt(tokenizer, to_chat_messages(history), prefix_messages=pool_messages, tools=tools)
    return tokenizer.decode(ids)


def test_over_a_pool_the_template_writes_the_tools_into_the_calls_own_system_turn(hermes):
    text = pooled_text(hermes, PREFIX, HISTORY, SHOWN)
    assert text.startswith("<|im_start|>system\nYou are the analyst.\n\nYou may call these tools:\n<tools>\n")
    assert '"name": "Add"' in text.split("</tools>")[0]
    # Earlier calls and results come back as the template writes them.
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "Add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The shared prefix is untouched: prefix + continuation is the prefix followed by the call's turns alone.
    turns, tools = prepare_turns(hermes, to_chat_messages(HISTORY), SHOWN)
    assert text == render_messages(hermes, turns, generation_prompt=True, tools=tools)


def test_a_call_without_a_system_turn_gets_one_for_its_tools(hermes):
    text = pooled_text(hermes, PREFIX, [HumanMessage("Add 2 and 3.")], SHOWN)
    assert text.startswith(f"<|im_start|>system\n{TOOLS_SYSTEM_PROMPT}\n\nYou may call these tools:")


def test_without_a_pool_the_tools_go_where_the_template_puts_them(hermes):
    ids = encode_prompt(hermes, to_chat_messages(HISTORY), tools=SHOWN)
    assert hermes.decode(ids).startswith("<|im_start|>system\nYou are the analyst.\n\nYou may call these tools:")


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, OTHER_FORMAT_TEMPLATE])
def test_other_templates_get_the_documented_prompt_and_calls_written_out(tiny_tok, template):
    tokenizer = copy.deepcopy(tiny_tok)
    tokenizer.chat_template = template
    text = pooled_text(tokenizer, PREFIX, HISTORY, SHOWN)
    assert text.startswith(f"<|im_start|>system\n{SHOWN.prompt}<|im_end|>\n<|im_start|>system\nYou are the analyst.")
    assert '<|im_start|>assistant\n<tool_call>{"name": "Add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<|im_start|>tool\n5<|im_end|>" in text
    assert "AVAILABLE_TOOLS" not in text


def test_tool_calls_decode_end_to_end_under_a_template_with_tool_support(tmp_path):
    model, tokenizer = tiny_llama(), tiny_hermes_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    pool = SharedKVPool.prefill(model, tokenizer, PREFIX)
    chat = ChatPolyKV(model=str(tmp_path), max_tokens=160, temperature=1.0).with_pool(pool)
    for seed in range(3):
        message = chat.bind_tools([Add], tool_choice="any").invoke(HISTORY[:2], seed=seed)
        assert len(message.tool_calls) == 1
        Add.model_validate(message.tool_calls[0]["args"])
        assert pool_read(message) == pool.num_tokens
