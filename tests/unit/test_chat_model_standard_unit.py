"""langchain-tests' standard unit suite for ChatPolyKV (no model is loaded by any of these)."""

from __future__ import annotations

from langchain_tests.unit_tests import ChatModelUnitTests

from polykv_agents.chat.chat_model import ChatPolyKV


class TestChatPolyKVUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatPolyKV]:
        return ChatPolyKV

    @property
    def standard_chat_model_params(self) -> dict:
        # The unit suite adds api_key="test" for hosted APIs. A local model has none, and ChatPolyKV refuses a
        # setting it does not have rather than ignore it; the other standard parameters are all accepted.
        params = super().standard_chat_model_params
        assert params.pop("api_key") == "test"
        return params

    @property
    def chat_model_params(self) -> dict:
        return {"model": "SmolLM2-135M-Instruct", "temperature": 0.0}

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
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}
