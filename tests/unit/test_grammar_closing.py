"""Closing a grammar within the token budget (polykv_agents.sampling.grammar_closing) on a tiny random model: a
forced tool call or a structured answer that would run past ``max_tokens`` is completed in time and parses."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from polykv_agents import ChatPolyKV, SharedKVPool, ToolCallCutError, load_model
from polykv_agents.sampling.grammar import TokenConstraint, json_schema_grammar
from polykv_agents.sampling.grammar_closing import JsonScanner, TokenTexts, closing_walk
from polykv_agents.sampling.settings import eos_token_ids


class Plan(BaseModel):
    title: str
    steps: list[str]
    priority: int


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@pytest.fixture(params=["private", "batched"])
def chat(request, tiny_model_dir) -> ChatPolyKV:
    """Without a pool (the private loop) and over one (the batched scheduler): both close the grammar."""
    chat = ChatPolyKV(model=tiny_model_dir, temperature=1.0, seed=3)
    if request.param == "private":
        return chat
    model, tokenizer = load_model(tiny_model_dir)
    return chat.with_pool(SharedKVPool.prefill(model, tokenizer, "A plan needs a title, steps and a priority. " * 3))


@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_tool_call_that_would_run_past_max_tokens_is_closed_in_time(chat, parallel):
    """The random model writes a number that never ends; the call is closed within 80 tokens instead of cut. With
    parallel calls allowed the grammar could go on after it: the answer ends there instead."""
    bound = chat.model_copy(update={"max_tokens": 80}).bind_tools(
        [multiply], tool_choice="any", parallel_tool_calls=parallel
    )
    reply = bound.invoke("What is 6 times 7?")
    (call,) = reply.tool_calls
    assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}
    assert reply.invalid_tool_calls == []
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.response_metadata["grammar_closed"] is True
    assert reply.usage_metadata["output_tokens"] <= 80
    with pytest.raises(ToolCallCutError, match="max_tokens=80"):
        bound.invoke("What is 6 times 7?", close_grammar=False)


def test_structured_output_is_closed_in_time_and_parses(chat):
    structured = chat.model_copy(update={"max_tokens": 40}).with_structured_output(Plan, include_raw=True)
    result = structured.invoke("Plan the review.")
    assert result["parsing_error"] is None and isinstance(result["parsed"], Plan)
    assert result["raw"].response_metadata["grammar_closed"] is True
    assert result["raw"].usage_metadata["output_tokens"] <= 40
    cut = chat.model_copy(update={"max_tokens": 40, "close_grammar": False}).with_structured_output(
        Plan, include_raw=True
    )
    assert cut.invoke("Plan the review.")["parsing_error"] is not None


def test_a_budget_too_small_for_any_complete_call_is_still_cut(tiny_model_dir):
    """The shortest call to ``multiply`` is longer than 30 byte-level tokens: nothing can close it."""
    bound = ChatPolyKV(model=tiny_model_dir, max_tokens=30).bind_tools([multiply], tool_choice="any")
    with pytest.raises(ToolCallCutError):
        bound.invoke("What is 6 times 7?")


def test_an_answer_the_model_finishes_itself_is_not_flagged(tiny_model_dir):
    reply = ChatPolyKV(model=tiny_model_dir, max_tokens=200).with_structured_output(
        {"title": "Answer", "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        include_raw=True,
    )
    raw = reply.invoke("Is it ok?")["raw"]
    assert "grammar_closed" not in raw.response_metadata


@pytest.mark.parametrize(
    ("written", "in_string"),
    [('{"a": "x', True), ('{"a": "x"', False), ('{"a": "say \\"hi', True), ('{"a": "back\\\\"', False)],
)
def test_the_scanner_follows_strings_and_escapes(written, in_string):
    scanner = JsonScanner()
    scanner.feed(written)
    assert scanner.in_string is in_string


@pytest.mark.parametrize(
    "written",
    [
        '{"title":"A long ti',
        '{"title":"T","steps":["one","tw',
        '{"title":"T","steps":[]',
        '{"title":"T","steps":[],"priority":12',
    ],
)
def test_the_closing_walk_completes_a_partial_answer_into_valid_json(tiny_model_dir, written):
    """The grammar is compact JSON; the walk's tokens make each partial answer valid, within the walk's limit."""
    model, tokenizer = load_model(tiny_model_dir)
    vocab = model.config.vocab_size
    grammar = json_schema_grammar(Plan.model_json_schema())
    constraint = TokenConstraint(grammar, tokenizer, vocab, eos_token_ids(model, tokenizer))
    for token in tokenizer(written, add_special_tokens=False).input_ids:
        constraint.advance(token)
    texts = TokenTexts.of(tokenizer, vocab)
    walk = closing_walk(constraint._matcher, constraint._scanner, texts, limit=64)
    assert walk is not None
    Plan.model_validate(json.loads(written + tokenizer.decode(walk)))
    assert closing_walk(constraint._matcher, constraint._scanner, texts, limit=len(walk) - 1) is None


def test_once_closing_a_grammar_that_may_go_on_ends_the_answer(tiny_model_dir):
    """After a complete call, a parallel-calls grammar allows another one: a call being closed ends there (an
    end-of-turn token), while one the model is writing freely lets the model choose."""
    from polykv_agents.prompting.tool_calls import format_tools, normalize_tool_choice, tool_call_grammar

    model, tokenizer = load_model(tiny_model_dir)
    eos = sorted(eos_token_ids(model, tokenizer))
    tools = format_tools([multiply])
    grammar = tool_call_grammar(tools, normalize_tool_choice("any", tools), parallel=True)
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
    for closing in (False, True):
        constraint = TokenConstraint(grammar, tokenizer, model.config.vocab_size, eos)
        for token in tokenizer(call, add_special_tokens=False).input_ids:
            constraint.advance(token)
        assert not constraint.finished  # another call may follow
        constraint.closing = closing
        assert constraint.closing_token(remaining=3) == (eos[0] if closing else None)
