"""The names ChatPolyKV accepts, at construction and per call: its own, a few aliases, and clear errors for the rest.

A setting a chat model silently ignores is a bug the user cannot see: ``ChatPolyKV(model_name="x")`` used to
keep SmolLM2, and ``max_new_tokens=5`` kept the 256-token default. So a name that is not a setting is
refused, with the field it probably meant: names other integrations use (transformers' ``max_new_tokens``,
Ollama's ``num_predict``) point to ours, and a misspelling gets the closest names. ``model_name`` and
``model_id`` (LangChain's and transformers' spellings of the model) are accepted as aliases of ``model``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

MODEL_ALIASES = ("model_name", "model_id")
"""Accepted for ``model``, at construction."""

POINTERS: Mapping[str, str] = {
    "max_new_tokens": "max_tokens",
    "num_predict": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "max_length": "max_tokens",
    "stop_sequences": "stop",
    "repeat_penalty": "repetition_penalty",
    "num_ctx": "the pool (the context is the document's pool plus each call's own tokens)",
    "device_map": "device",
    "torch_dtype": "dtype",
}
"""Other integrations' names for what is here called otherwise: refused, naming ours."""

CALL_KWARGS = frozenset(
    {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "ignore_eos", "model",
        "logprobs", "top_logprobs", "close_grammar", "reuse", "block_recompute",
        "tools", "tool_choice", "parallel_tool_calls", "response_format",
    }
)  # fmt: skip
"""What one call may override (``chat.invoke(messages, max_tokens=...)``, ``bind(...)``, ``bind_tools``)."""


def _unknown(name: str, known: Iterable[str], where: str) -> ValueError:
    if name in POINTERS:
        return ValueError(f"{where} has no setting {name!r}: use {POINTERS[name]!r} instead")
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return ValueError(f"{where} has no setting {name!r}{hint} Its settings: {', '.join(sorted(known))}")


def with_model_alias(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``model_name`` / ``model_id`` moved to ``model``.

    Raises:
        ValueError: Two of them name different models.
    """
    given = {name: values[name] for name in ("model", *MODEL_ALIASES) if name in values}
    if len(set(map(str, given.values()))) > 1:
        msg = f"{' and '.join(given)} name different models ({given}); pass the model once, as model="
        raise ValueError(msg)
    if given:
        values = {k: v for k, v in values.items() if k not in MODEL_ALIASES}
        values["model"] = next(iter(given.values()))
    return values


def check_settings(values: Mapping[str, Any], known: Iterable[str], where: str = "ChatPolyKV") -> None:
    """Refuse a name in ``values`` that is not in ``known``.

    Raises:
        ValueError: The first unknown name, with the setting it probably meant.
    """
    known = set(known)
    for name in values:
        if name not in known:
            raise _unknown(name, known, where)


def check_call_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse a per-call keyword that no call reads (it would otherwise be ignored without a word).

    Raises:
        ValueError: The first unknown keyword, with the one it probably meant.
    """
    check_settings(kwargs, CALL_KWARGS, where="a ChatPolyKV call")
