"""langchain-tests' standard integration suite, on the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import functools
import tempfile

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from tiny_models import tiny_llama, tiny_tokenizer

from polykv_agents import SharedKVPool, ToolCallCutError, load_model
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


# Measured: SmolLM2-135M repeats itself inside these tests' free-text strings ("The cat was a cat, and the cat was
# a cat, ...") until max_tokens. The grammar keeps every token valid JSON; the parser then rightly refuses the
# unfinished document. That is the 135M model's ability, not the code: the same paths are checked with prompts
# it can finish in tests/integration/test_structured_output_smollm.py and tests/unit/test_structured_output.py.
LOOPS_IN_STRINGS = pytest.mark.xfail(
    reason="SmolLM2-135M loops inside the joke's free-text string until max_tokens; the unfinished JSON is refused",
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
        assert message.usage_metadata["input_token_details"]["cache_read"] == pool.num_tokens
        return message

    @LOOPS_IN_STRINGS
    @pytest.mark.parametrize("schema_type", SCHEMA_TYPES)
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @LOOPS_IN_STRINGS
    @pytest.mark.parametrize("schema_type", SCHEMA_TYPES)
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @LOOPS_IN_STRINGS
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @LOOPS_IN_STRINGS
    def test_structured_output_optional_param(self, model) -> None:
        super().test_structured_output_optional_param(model)

    @LOOPS_IN_STRINGS
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        reason="SmolLM2-135M loops inside the customer description string until max_tokens, so the call never closes",
        raises=ToolCallCutError,  # a forced call cut by max_tokens is an error, never text
        strict=True,
    )
    def test_unicode_tool_call_integration(self, model, *args, **kwargs) -> None:
        super().test_unicode_tool_call_integration(model, *args, **kwargs)

    @pytest.mark.xfail(
        reason="with tool_choice='auto', SmolLM2-135M answers the weather question in text instead of calling the tool",
        raises=AssertionError,  # both cases: the suite's check for a tool_call content block
        strict=True,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)  # as the base test does
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)
