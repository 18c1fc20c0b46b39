"""Structured output on the embedded SmolLM2-135M-Instruct over a pool: a 135M model answers in the
schema every time, because decoding is constrained (unconstrained, it rarely writes valid JSON)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from polykv_agents import SharedKVPool
from polykv_agents.chat_model import ChatPolyKV


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
