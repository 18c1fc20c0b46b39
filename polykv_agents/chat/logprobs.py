"""Log-probabilities in a chat answer: the chat model's ``logprobs``/``top_logprobs`` settings, and the answer's
token log-probabilities in ChatOpenAI's ``response_metadata["logprobs"]`` form."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from polykv_agents.sampling.logprobs import TokenLogprob


def logprobs_setting(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """The runtime's ``logprobs`` setting: ``None`` (off), else how many alternatives to report."""
    if logprobs is None and top_logprobs:  # logprobs=False explicitly (a call turning them off) wins
        msg = f"top_logprobs={top_logprobs} needs logprobs=True"
        raise ValueError(msg)
    if not logprobs:
        return None
    return top_logprobs or 0


def openai_logprobs(logprobs: Sequence[TokenLogprob], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The answer's token log-probabilities as ChatOpenAI's ``response_metadata["logprobs"]`` holds them."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}

    content = [
        {**entry(item.token_id, item.logprob), "top_logprobs": [entry(t, lp) for t, lp in item.top]}
        for item in logprobs
    ]
    return {"content": content}
