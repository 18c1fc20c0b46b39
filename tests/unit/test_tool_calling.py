"""bind_tools on a tiny random checkpoint: whatever the model would say, tool calls parse, name a bound
tool, validate against its parameters and carry ids; stop sequences end text answers, never calls."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from pydantic import BaseModel, Field

from polykv_agents import SharedKVPool, ToolCallCutError, load_model
from polykv_agents.chat.chat_model import ChatPolyKV, _BoundTools
from polykv_agents.chat.messages import to_chat_messages
from polykv_agents.prompting.tool_calls import (
    CALL_OPEN,
    format_tools,
    normalize_tool_choice,
    parse_tool_calls,
    tool_call_grammar,
)
from polykv_agents.prompting.tool_prompts import prepare_turns
from polykv_agents.sampling.grammar import GrammarError, TokenConstraint

DOC = "The register lists three risks: drought, ageing mains and workforce. " * 4


class Add(BaseModel):
    """Add two digits."""

    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


class Lookup(BaseModel):
    """Look up the mitigation of a risk in the register."""

    risk: Literal["drought", "mains", "workforce"]


TOOLS = [Add, Lookup]
ARGS = {"Add": Add, "Lookup": Lookup}


@pytest.fixture(scope="module")
def chat(tiny_model_dir) -> ChatPolyKV:
    model, tokenizer = load_model(tiny_model_dir)
    pool = SharedKVPool.prefill(model, tokenizer, DOC)
    return ChatPolyKV(model=tiny_model_dir, max_tokens=80, temperature=1.0).with_pool(pool)


def check_calls(message: AIMessage, names=("Add", "Lookup"), *, count: int | None = 1) -> None:
    """Every call names a bound tool, validates and has its own id; ``count`` calls when given."""
    assert message.content == ""
    assert message.tool_calls and (count is None or len(message.tool_calls) == count)
    for call in message.tool_calls:
        assert call["name"] in names and call["id"].startswith("call_")
        ARGS[call["name"]].model_validate(call["args"])
    assert len({call["id"] for call in message.tool_calls}) == len(message.tool_calls)
    # A call cut short by max_tokens after complete ones is dropped, and the answer says it ran out.
    assert message.response_metadata["finish_reason"] in (("tool_calls",) if count == 1 else ("tool_calls", "length"))


@pytest.mark.parametrize("seed", range(5))
def test_required_tool_calls_always_parse_and_validate(chat, seed):
    check_calls(chat.bind_tools(TOOLS, tool_choice="any").invoke("Add 2 and 3.", seed=seed))


@pytest.mark.parametrize("seed", range(3))
def test_parallel_calls_each_parse_and_validate(chat, seed):
    bound = chat.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=True)
    check_calls(bound.invoke("Add 2 and 3, then look up drought.", seed=seed), count=None)
    # The random model rarely stops after one call: allowed several, it writes several.
    assert any(len(bound.invoke("Add 2 and 3.", seed=s, max_tokens=240).tool_calls) > 1 for s in range(4))


@pytest.mark.parametrize("choice", ["Lookup", {"type": "function", "function": {"name": "Lookup"}}])
def test_a_named_tool_choice_calls_that_tool(chat, choice):
    check_calls(chat.bind_tools(TOOLS, tool_choice=choice).invoke("Which risk is worst?", seed=1), names=("Lookup",))


@pytest.mark.parametrize("seed", range(5))
def test_auto_gives_either_text_or_valid_calls(chat, seed):
    message = chat.bind_tools(TOOLS).invoke("Add 2 and 3, or just answer.", seed=seed)
    if message.tool_calls:
        check_calls(message)
    else:
        assert not message.content.lstrip().startswith("<")


def test_stop_sequences_end_a_text_answer_under_auto(chat):
    """tool_choice="auto" keeps a grammar on every token, yet a plain-text answer still ends at its stop."""
    bound = chat.bind_tools(TOOLS)
    texts = [bound.invoke("Just answer in words.", seed=seed, max_tokens=40) for seed in range(8)]
    text = next(m.content for m in texts if not m.tool_calls and len(m.content) > 12)
    stop = text[6:9]
    seed = next(seed for seed, m in enumerate(texts) if m.content == text)
    stopped = bound.invoke("Just answer in words.", seed=seed, max_tokens=40, stop=[stop])
    assert stopped.content == text[: text.index(stop)]
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_stop_sequences_never_cut_a_tool_call(chat):
    message = chat.bind_tools(TOOLS, tool_choice="any").invoke("Look it up.", seed=2, stop=['"', "name", "}"])
    check_calls(message)


def test_none_shows_no_tools_and_constrains_nothing(chat):
    none = _BoundTools.from_kwargs({"tools": format_tools(TOOLS), "tool_choice": "none"}, parallel_default=True)
    assert none == _BoundTools(None, None)
    message = chat.bind_tools(TOOLS, tool_choice="none").invoke("Answer in words.", seed=0)
    assert message.tool_calls == [] and isinstance(message.content, str)


def test_streaming_sends_the_calls_whole_never_as_text(chat):
    chunks = list(chat.bind_tools(TOOLS, tool_choice="Add").stream("Add 2 and 3.", seed=3))
    assert all(CALL_OPEN not in chunk.content for chunk in chunks)
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    message = AIMessage(content=full.content, tool_calls=full.tool_calls, response_metadata=full.response_metadata)
    check_calls(message, names=("Add",))


@pytest.mark.parametrize("max_tokens", [2, 24])  # inside the opening tag (5 tokens here), then after it
def test_a_forced_call_cut_by_max_tokens_is_an_error_never_text(chat, max_tokens):
    with pytest.raises(
        ToolCallCutError, match=f"still open when max_tokens={max_tokens} ran out: '<.*Raise max_tokens"
    ):
        chat.bind_tools(TOOLS, tool_choice="any").invoke("Add 2 and 3.", max_tokens=max_tokens)


@pytest.mark.parametrize(
    "decoded",
    [
        '<tool_call>{"name": "Add", "arguments": {"a": 2, "b": ',
        "<tool_c",
        '<tool_call>{"name": "Add", "arguments": {}}',
    ],
)
def test_under_auto_a_call_cut_by_max_tokens_is_an_invalid_tool_call_never_text(decoded):
    """What reaches the user after LangChain merges the chunks: the cut call (in its tag, or inside the tag
    itself) is an invalid_tool_calls entry; the merge must not complete it into a call with missing arguments."""
    from langchain_core.language_models.chat_models import generate_from_stream
    from langchain_core.outputs import ChatGenerationChunk

    from polykv_agents.chat.chat_model import _tool_calls_chunk

    tools = _BoundTools.from_kwargs({"tools": format_tools(TOOLS), "tool_choice": "auto"}, parallel_default=False)
    chunk, finish_reason, cut = _tool_calls_chunk(decoded, "length", tools, max_tokens=12)
    last = ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last"))
    message = generate_from_stream(iter([chunk, last])).generations[0].message
    assert message.content == "" and message.tool_calls == [] and cut and finish_reason == "length"
    (invalid,) = message.invalid_tool_calls
    assert invalid["args"] == decoded.strip() and invalid["name"] == ("Add" if '"Add"' in decoded else None)


def test_parsing_reads_each_call_as_json_and_keeps_a_cut_tail_apart():
    text = (
        '<tool_call>{"name": "Echo", "arguments": {"s": "a </tool_call> b"}}</tool_call>\n'
        '<tool_call>\n{"name": "Add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "Add", "argu'
    )
    calls, cut = parse_tool_calls(text)
    assert [(c["name"], c["args"]) for c in calls] == [("Echo", {"s": "a </tool_call> b"}), ("Add", {"a": 1, "b": 2})]
    assert cut == '<tool_call>{"name": "Add", "argu'
    assert parse_tool_calls("The answer is 5.") is None
    assert parse_tool_calls('<tool_call>{"name": "Add"}</tool_call>') == ([], '<tool_call>{"name": "Add"}</tool_call>')


def test_function_calling_structured_output_returns_the_tool_arguments(chat):
    assert isinstance(chat.with_structured_output(Add, method="function_calling").invoke("Add 2 and 3."), Add)
    raw = chat.with_structured_output(Lookup, method="function_calling", include_raw=True).invoke("Worst risk?")
    assert isinstance(raw["parsed"], Lookup) and raw["raw"].tool_calls


def test_earlier_calls_and_their_results_render_back_into_the_conversation(tiny_tok):
    """SmolLM2-style templates (no tool support): calls are written into the assistant's text."""
    calls = [
        {"name": "Add", "args": {"a": 2, "b": 3}, "id": "call_1", "type": "tool_call"},
        {"name": "Lookup", "args": {"risk": "mains"}, "id": "call_2", "type": "tool_call"},
    ]
    history = [HumanMessage("Add 2 and 3."), AIMessage("", tool_calls=calls), ToolMessage("5", tool_call_id="call_1")]
    turns, template_tools = prepare_turns(tiny_tok, to_chat_messages(history), None)
    assert template_tools is None
    assert turns[1] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "Add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
        '<tool_call>{"name": "Lookup", "arguments": {"risk": "mains"}}</tool_call>',
    }
    assert turns[2] == {"role": "tool", "content": "5"}


def test_tool_choice_spellings_and_bad_choices():
    tools = format_tools(TOOLS)
    assert [normalize_tool_choice(c, tools) for c in (None, "auto", "any", "required", True, "none", "Add")] == [
        "auto", "auto", "required", "required", "required", "none", "Add"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"one of the tools \['Add', 'Lookup'\]"):
        normalize_tool_choice("Multiply", tools)


def test_tool_parameters_that_cannot_be_compiled_fail_at_bind_time(chat):
    broken = {
        "type": "function",
        "function": {
            "name": "broken",
            "description": "x",
            "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}},
        },
    }
    with pytest.raises(GrammarError, match="cannot be compiled"):
        chat.bind_tools([broken], tool_choice="any")
    with pytest.raises(ValueError, match="not both"):
        chat.bind_tools(TOOLS, tool_choice="any").invoke("Go.", response_format={"type": "json_object"})


def test_auto_text_may_not_start_with_whitespace_so_the_first_token_decides(tiny_tok):
    """Otherwise a newline first would let an unchecked '<tool_call>' follow as free text."""
    grammar = tool_call_grammar(format_tools(TOOLS), "auto")
    space = tiny_tok(" ", add_special_tokens=False).input_ids[0]
    constraint = TokenConstraint(grammar, tiny_tok, 320, [2])
    with pytest.raises(GrammarError):
        constraint.advance(space)


def test_empty_tools_bind_nothing(chat):
    message = chat.bind_tools([]).invoke("Go.", max_tokens=5)
    assert message.tool_calls == []


def test_a_conversation_ending_in_unanswered_tool_calls_is_refused(chat):
    call = {"name": "Add", "args": {"a": 2, "b": 3}, "id": "call_1", "type": "tool_call"}
    with pytest.raises(ValueError, match="add a ToolMessage"):
        chat.invoke([HumanMessage("Add 2 and 3."), AIMessage("", tool_calls=[call])])
