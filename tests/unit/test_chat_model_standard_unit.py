"""langchain-tests' standard unit suite for ChatPolyKV (no model is loaded by any of these)."""

from __future__ import annotations

from langchain_tests.unit_tests import ChatModelUnitTests

from polykv_agents.chat_model import ChatPolyKV


class TestChatPolyKVUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatPolyKV]:
        return ChatPolyKV

    @property
    def chat_model_params(self) -> dict:
        return {"model": "SmolLM2-135M-Instruct", "temperature": 0.0}

    @property
    def has_tool_calling(self) -> bool:
        return False  # grammar-constrained tool calling comes with the structured-output work

    @property
    def has_structured_output(self) -> bool:
        # json_schema and json_mode work (tests/unit/test_structured_output.py); the standard test also asks
        # for method="function_calling", which comes with bind_tools.
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}
