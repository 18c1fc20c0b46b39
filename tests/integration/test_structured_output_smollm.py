"""Structured output on the embedded SmolLM2-135M-Instruct over a pool: a 135M model answers in the
schema every time, because decoding is constrained (unconstrained, it rarely writes valid JSON)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from polykv_agents import SharedKVPool
from polykv_agents.chat.chat_model import ChatPolyKV


class ReviewPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: list[str] = Field(description="Short review steps", min_length=1, max_length=3)
    priority: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def chat(smollm, sample_document) -> ChatPolyKV:
    model, tokenizer = smollm
    pool = SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": sample_document}])
    return ChatPolyKV(max_tokens=160).with_pool(pool)


def test_a_pydantic_plan_comes_back_typed(chat):
    result = chat.with_structured_output(ReviewPlan, include_raw=True).invoke("Plan a review of this document.")
    assert result["parsing_error"] is None, result["raw"].content
    assert isinstance(result["parsed"], ReviewPlan)
    assert result["raw"].usage_metadata["input_token_details"]["cache_read"] > 1000  # read from the pool


def test_json_mode_gives_a_json_object(chat):
    result = chat.with_structured_output(method="json_mode").invoke("List the three principal risks as JSON.")
    assert isinstance(result, dict) and result


class SearchDocument(BaseModel):
    """Find the paragraphs of the document that mention a topic."""

    topic: str = Field(max_length=40)


class PercentChange(BaseModel):
    """The change from old to new, in percent."""

    old: float
    new: float


@pytest.mark.parametrize(
    "question", ["Find where the document mentions drought.", "By what percent did leakage rise from 16.8 to 19.4?"]
)
def test_tool_calls_on_smollm_parse_validate_and_carry_ids(chat, question):
    """Forced calls (tool_choice="any") from the 135M model: always one call, to a bound tool, with valid args."""
    message = chat.bind_tools([SearchDocument, PercentChange], tool_choice="any").invoke(question)
    assert len(message.tool_calls) == 1 and message.content == ""
    call = message.tool_calls[0]
    {"SearchDocument": SearchDocument, "PercentChange": PercentChange}[call["name"]].model_validate(call["args"])
    assert call["id"].startswith("call_")
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert message.usage_metadata["input_token_details"]["cache_read"] > 1000
