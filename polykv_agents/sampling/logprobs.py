"""Log-probabilities of the tokens an answer chose, as OpenAI's ``logprobs`` report them.

Taken from the model's own distribution at each step (log-softmax of the raw logits, before temperature,
top-k/top-p, penalties or a grammar's mask), as vLLM's default ``raw_logprobs`` mode does: a grammar can
force a token the model found unlikely, and its logprob says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""Most alternatives reported per token (OpenAI's limit)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token: its id and log-probability, and the ``top`` most likely ids with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of ``token`` under ``logits [vocab]``, and the ``top`` most likely tokens'."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = logprobs.topk(top)
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), alternatives)
