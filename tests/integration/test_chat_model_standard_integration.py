"""langchain-tests' standard integration suite, on the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import functools
import tempfile

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from tiny_models import tiny_llama, tiny_tokenizer

from polykv_agents import SharedKVPool, load_model
from polykv_agents.chat_model import ChatPolyKV

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


class TestChatPolyKVIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPolyKV]:
        return ChatPolyKV

    @property
    def chat_model_params(self) -> dict:
        return {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0.0}

    @property
    def has_tool_calling(self) -> bool:
        return False  # grammar-constrained tool calling comes with the structured-output work

    @property
    def has_structured_output(self) -> bool:
        # with_structured_output works (tests/integration/test_structured_output_smollm.py); the standard
        # structured-output tests still need a per-call token budget above this suite's 24 tokens, and
        # xfails named for the 135M model's looping inside strings: the next step of the tool-calling work.
        return False

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
