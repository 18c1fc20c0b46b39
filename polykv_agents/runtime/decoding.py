"""The decode loop shared by PooledAgent and the chat model.

One call:
  prompt ids ``[n]`` (the turns after the pool's prefix, or a whole prompt without a pool)
  -> a cache of the call's own: seeded from the decoded pool, or empty
  -> forward the prompt at positions ``T .. T+n-1`` (``T`` = pool tokens, 0 without a pool)
  -> one token at a time until EOS, the token budget, or a stop sequence in the text.

A call never writes the pool: it decodes it into a cache that only this call holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from polykv_agents.model.compat import forward_with_cache, new_dynamic_cache
from polykv_agents.pool.documents import max_positions
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime import scheduler
from polykv_agents.sampling.settings import (
    GenerationSettings,
    GenerationStats,
    choose_token,
    eos_token_ids,
    token_constraint,
)
from polykv_agents.sampling.text_stream import StopAwareDetokenizer


@torch.inference_mode()
def _forward_last(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, start_position: int) -> torch.Tensor:
    logits = forward_with_cache(
        model, ids.to(model.device).unsqueeze(0), cache, start_position=start_position, logits_to_keep=1
    )
    return logits[0, -1]  # [vocab]


Runtime = Literal["decompressed", "compressed", "private"]
"""How a pooled call reads the pool. ``decompressed`` / ``compressed``: through the batched
scheduler over one shared prefix (kept decoded, or decoded per layer on the fly). ``private``: the
reference design, the whole pool decoded into a cache of the call's own (a baseline for benchmarks)."""


def _token_budget(model: PreTrainedModel, start: int, prompt_ids: torch.Tensor, settings: GenerationSettings) -> int:
    limit = max_positions(model)
    if limit is None:
        return settings.max_new_tokens
    if start + prompt_ids.numel() >= limit:
        msg = (
            f"the pool ({start} tokens) plus this prompt ({prompt_ids.numel()} tokens) exceeds the model's "
            f"{limit} positions; use a shorter document or prompt"
        )
        raise ValueError(msg)
    return min(settings.max_new_tokens, limit - start - prompt_ids.numel())


def _private_cache_tokens(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cache: Cache,
    start: int,
    prompt_ids: torch.Tensor,
    settings: GenerationSettings,
    budget: int,
    stats: GenerationStats,
) -> Iterator[int]:
    """The one-sequence loop over a cache this call owns (``prompt_ids [n]`` at positions ``start ..``)."""
    eos_ids = eos_token_ids(model, tokenizer)
    generator = settings.make_generator()
    constraint = token_constraint(model, tokenizer, settings)
    logits = _forward_last(model, prompt_ids, cache, start)
    position = start + prompt_ids.numel()
    for step in range(budget):
        token, reason = choose_token(logits, settings, generator, constraint, eos_ids)
        if token is not None:
            yield token
        if reason is not None:
            stats.finish_reason = reason
            return
        if step + 1 < budget:
            logits = _forward_last(model, torch.tensor([token]), cache, position)
            position += 1
    stats.finish_reason = "length"


def generate_token_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: torch.Tensor,
    settings: GenerationSettings,
    *,
    pool: SharedKVPool | None = None,
    stats: GenerationStats | None = None,
    runtime: Runtime = "decompressed",
) -> Iterator[int]:
    """Generated token ids (EOS excluded). Stop sequences act on text: see :func:`generate_text`.

    With a pool, the call joins the pool's batched scheduler (unless ``runtime="private"``); without
    one, it decodes alone over an empty cache.

    Raises:
        ValueError: The pool plus the prompt do not fit in the model's positions.
    """
    stats = stats or GenerationStats(prompt_tokens=prompt_ids.numel(), cached_tokens=pool.num_tokens if pool else 0)
    start = pool.num_tokens if pool is not None else 0
    budget = _token_budget(model, start, prompt_ids, settings)
    if budget == 0:
        stats.finish_reason = "length"
        return
    if pool is not None and runtime != "private":
        tokens = scheduler.submit(model, tokenizer, pool, runtime, prompt_ids, settings, stats, budget)
    else:
        with torch.inference_mode():
            cache = pool.to_cache(model) if pool is not None else new_dynamic_cache(model)
        tokens = _private_cache_tokens(model, tokenizer, cache, start, prompt_ids, settings, budget, stats)
    try:
        for token in tokens:
            stats.output_tokens += 1
            yield token
    finally:
        tokens.close()  # cancels a scheduled request / frees a private cache at once


def generate_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: torch.Tensor,
    settings: GenerationSettings,
    *,
    pool: SharedKVPool | None = None,
    stats: GenerationStats | None = None,
    runtime: Runtime = "decompressed",
) -> Iterator[str]:
    """Text pieces as they are decoded, ending before the first stop sequence.

    Closing the iterator early (a consumer that stops reading, a cancelled request) closes the
    token loop too, which frees the call's cache at once.
    """
    # Under a grammar the grammar decides the end: a stop sequence inside a JSON string must not cut it.
    detokenizer = StopAwareDetokenizer(tokenizer, settings.text_stops, structured_opening=settings.structured_opening)
    tokens = generate_token_ids(model, tokenizer, prompt_ids, settings, pool=pool, stats=stats, runtime=runtime)
    try:
        for token in tokens:
            piece = detokenizer.push(token)
            if piece:
                yield piece
            if detokenizer.stopped:
                if stats is not None:
                    stats.finish_reason = "stop"
                return
        tail = detokenizer.finish()
        if tail:
            yield tail
    finally:
        tokens.close()
