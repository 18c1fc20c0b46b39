"""langchain-tests' standard integration suite, on the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import functools
import tempfile

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from tiny_models import tiny_llama, tiny_tokenizer
from usage import pool_read

from polykv_agents import SharedKVPool, load_model
from polykv_agents.chat.chat_model import ChatPolyKV

pytestmark = pytest.mark.real_model


@functools.cache
def _override_model_dir() -> str:
    """A second local model (tiny, random) for the model-override tests: nothing is downloaded."""
    directory = tempfile.mkdtemp(prefix="polykv-override-model-")
    tiny_llama().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@functools.cache
def _sample_pool() -> SharedKVPool:
    from importlib import resources

    model, tokenizer = load_model()
    text = resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    return SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": text}])


# Measured: under json_mode (any JSON object, no schema) SmolLM2-135M nests the joke's keys into each other
# ({"setup": {"setup": {...}}}) until max_tokens. Closed in time (grammar closing), the answer parses as JSON, but it
# is not a Joke, and the strict parser says so. That is the 135M model's ability, not the code. (The schema tests,
# where it used to loop inside free-text strings until max_tokens, pass since answers are closed within the budget.)
NESTS_KEYS = pytest.mark.xfail(
    reason="under json_mode SmolLM2-135M nests the joke's keys into each other; the closed JSON is not a Joke",
    raises=OutputParserException,  # the strict parser's refusal, nothing else
    strict=True,  # greedy decoding is deterministic: a pass means the model or the code changed, so look
)


SCHEMA_TYPES = ["pydantic", "typeddict", "json_schema"]  # as the base tests parametrize them


class TestChatPolyKVIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPolyKV]:
        return ChatPolyKV

    @property
    def chat_model_params(self) -> dict:
        return {"model": "SmolLM2-135M-Instruct", "max_tokens": 64, "temperature": 0.0}

    @property
    def has_tool_calling(self) -> bool:
        return True  # grammar-constrained (polykv_agents/prompting/tool_calls.py)

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True  # json_schema, json_mode and function_calling, each under a grammar

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        return _override_model_dir()

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        pool = _sample_pool()
        chat = ChatPolyKV(**self.chat_model_params).with_pool(pool)
        messages = [SystemMessage("You are the risk officer."), HumanMessage("Name one risk.")]
        if stream:
            full = None
            for chunk in chat.stream(messages):
                full = chunk if full is None else full + chunk
            message = full
        else:
            message = chat.invoke(messages)
        assert pool_read(message) == pool.num_tokens
        return message

    @NESTS_KEYS
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        reason="with tool_choice='auto', SmolLM2-135M answers the weather question in text instead of calling the tool",
        raises=AssertionError,  # both cases: the suite's check for a tool_call content block
        strict=True,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)  # as the base test does
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)
