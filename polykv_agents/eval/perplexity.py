"""The paper's quality protocol: perplexity of the text that follows a document prefix.

For one text: tokens ``[0, C)`` are the prefix and ``[C, C+M)`` the continuation. The prefix is
prefilled once; its full-precision cache and the pool made from that very cache (one pool per
compression config) each condition the same continuation, and the continuation's perplexity is
compared:

    delta_pct = 100 * (ppl_pool - ppl_full) / ppl_full

Both sides score the same ``M - 1`` tokens (each continuation token after the first, predicted
from the continuation's own logits), so only the cache differs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.config import CompressionConfig
from polykv_agents.model.architecture import check_causal_lm
from polykv_agents.model.compat import cache_from_key_values, forward_with_cache, layer_key_values
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.pool.documents import max_positions
from polykv_agents.pool.prefill import DEFAULT_CHUNK_SIZE, prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool


class PerplexityResult(BaseModel):
    """One (text, context length, config) measurement."""

    model_name: str
    dtype: str
    config: str
    num_tokens: int
    """Prefix (pool) tokens."""
    continuation_tokens: int
    ppl_full: float
    ppl_pool: float
    delta_pct: float
    pool_nbytes: int
    fp16_nbytes: int
    model_dtype_nbytes: int
    compression_ratio: float


@torch.inference_mode()
def continuation_nll(model: PreTrainedModel, cache, continuation: torch.Tensor, start: int) -> float:
    """Mean negative log-likelihood of ``continuation[1:]`` given ``cache`` (consumed), on the compute thread
    (the loss over ``[M, vocab]`` logits is as much tensor work as the forward)."""
    return run_on_compute_thread(_continuation_nll, model, cache, continuation, start)


def _continuation_nll(model: PreTrainedModel, cache, continuation: torch.Tensor, start: int) -> float:
    logits = forward_with_cache(model, continuation.unsqueeze(0).to(model.device), cache, start_position=start)
    # logits[0, i] predicts continuation[i + 1]: [M - 1, vocab] against [M - 1]
    return F.cross_entropy(logits[0, :-1].float(), continuation[1:].to(logits.device)).item()


def prefix_and_continuation(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str, context_tokens: int, continuation_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The protocol's token split of ``text``: ``(prefix [context_tokens], continuation [continuation_tokens])``.

    Raises:
        ValueError: The text is shorter than ``context_tokens + continuation_tokens``, the lengths are
            out of range, or longer than the model's positions or sliding window.
    """
    check_causal_lm(model)
    if context_tokens < 1 or continuation_tokens < 2:
        msg = "context_tokens must be >= 1 and continuation_tokens >= 2 (one token is scored per following token)"
        raise ValueError(msg)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]  # [N]
    needed = context_tokens + continuation_tokens
    if ids.numel() < needed:
        msg = (
            f"the document has {ids.numel()} tokens but context_tokens + continuation_tokens = {needed}; "
            "use a longer document or smaller lengths"
        )
        raise ValueError(msg)
    limit = max_positions(model)
    if limit is not None and needed > limit:
        msg = (
            f"context_tokens + continuation_tokens = {needed}, but the model covers at most {limit} positions; "
            "use smaller lengths"
        )
        raise ValueError(msg)
    return ids[:context_tokens], ids[context_tokens:needed]


def perplexity_deltas(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    context_tokens: int,
    continuation_tokens: int,
    configs: Sequence[CompressionConfig],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> list[PerplexityResult]:
    """Perplexity with the full-precision prefix cache and with each config's pool, from one prefill.

    Raises:
        ValueError: The text is shorter than ``context_tokens + continuation_tokens``, the lengths are
            out of range, or longer than the model's positions or sliding window.
    """
    prefix, continuation = prefix_and_continuation(model, tokenizer, text, context_tokens, continuation_tokens)

    cache, _ = prefill_cache(model, prefix, chunk_size=chunk_size)
    full_key_values = layer_key_values(cache)
    nll_full = continuation_nll(model, cache_from_key_values(model, full_key_values), continuation, context_tokens)
    results = []
    for config in configs:
        pool = SharedKVPool.from_cache(model, tokenizer, cache, prefix, config=config)
        nll_pool = continuation_nll(model, pool.to_cache(model), continuation, context_tokens)
        ppl_full, ppl_pool = math.exp(nll_full), math.exp(nll_pool)
        results.append(
            PerplexityResult(
                model_name=pool.fingerprint.name,
                dtype=pool.fingerprint.dtype,
                config=config.label(),
                num_tokens=pool.num_tokens,
                continuation_tokens=continuation_tokens,
                ppl_full=ppl_full,
                ppl_pool=ppl_pool,
                delta_pct=100.0 * (ppl_pool - ppl_full) / ppl_full,
                pool_nbytes=pool.nbytes,
                fp16_nbytes=pool.fp16_nbytes,
                model_dtype_nbytes=pool.model_dtype_nbytes,
                compression_ratio=pool.compression_ratio,
            )
        )
    return results
