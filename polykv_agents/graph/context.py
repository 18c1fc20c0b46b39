"""Per-run settings of the polykv graphs: their LangGraph ``context_schema``.

A LangGraph Studio assistant (or ``graph.invoke(inputs, context={...})``, or a ``langgraph_sdk`` run's
``context``) sets these for one run; a field left out keeps what the graph was built with (its factory
arguments and environment variables). The prefetch node builds the pool with the run's model and preset,
and every role call of the run uses the same model, token budget and runtime, so a run never reads a pool
built with another model.

    graph.invoke({"document": text, "question": "..."}, context={"max_tokens": 64, "preset": "max"})

Unknown fields and bad values are refused before anything runs (pydantic validation), naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.config import PRESETS, CompressionConfig
from polykv_agents.model.weights import WeightsChoice
from polykv_agents.runtime.backend import Runtime


class PolyKVContext(BaseModel):
    """What one run of a polykv graph may set; ``None`` keeps the graph's own setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="Model id or path (default: the graph's chat model's).")
    max_tokens: int | None = Field(default=None, ge=1, description="Tokens per answer.")
    ignore_eos: bool | None = Field(
        default=None, description="Decode exactly max_tokens per answer, past end-of-sequence (equal work)."
    )
    runtime: Runtime | None = Field(
        default=None,
        description=(
            "auto (the faster residency here), decompressed, compressed (only the pool) or private (one copy per call)."
        ),
    )
    weights: WeightsChoice | None = Field(default=None, description="auto, native, int8 or int4 weight storage.")
    preset: str | None = Field(
        default=None, description=f"Compression preset of the pool: one of {', '.join(PRESETS)}."
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str | None) -> str | None:
        if name is not None and name not in PRESETS:
            msg = f"unknown compression preset {name!r}; choose one of {', '.join(PRESETS)}"
            raise ValueError(msg)
        return name

    def chat_settings(self) -> dict[str, Any]:
        """The chat model fields this context sets (the ones not left at ``None``)."""
        fields = ("model", "max_tokens", "ignore_eos", "runtime", "weights")
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}

    def apply_to_chat(self, chat: ChatPolyKV) -> ChatPolyKV:
        """``chat`` with this run's settings (validated here, with the chat model's own field types)."""
        settings = self.chat_settings()
        return chat.model_copy(update=settings) if settings else chat

    def apply_to_config(self, config: CompressionConfig) -> CompressionConfig:
        """The pool's compression for this run: the preset when one is set, else ``config``."""
        return config if self.preset is None else CompressionConfig.preset(self.preset)


def run_context(runtime: Any) -> PolyKVContext:
    """The :class:`PolyKVContext` of a node's LangGraph ``runtime`` (an empty one when the run set none)."""
    context = getattr(runtime, "context", None)
    if context is None:
        return PolyKVContext()
    if isinstance(context, PolyKVContext):
        return context
    return PolyKVContext.model_validate(context)  # a graph built with a plain dict context
