"""The decode loop shared by PooledAgent and the chat model.

One call:
  prompt ids ``[n]`` (the turns after the pool's prefix, or a whole prompt without a pool)
  -> a cache of the call's own: seeded from the decoded pool, or empty
  -> forward the prompt at positions ``T .. T+n-1`` (``T`` = pool tokens, 0 without a pool)
  -> one token at a time until EOS, the token budget, or a stop sequence in the text.

A call never writes the pool: it decodes it into a cache that only this call holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.compat import forward_with_cache, new_dynamic_cache
from polykv_agents.documents import max_positions
from polykv_agents.generation import GenerationSettings, next_token
from polykv_agents.pool import SharedKVPool
from polykv_agents.prompts import Message, render_continuation, render_prompt
from polykv_agents.text_stream import StopAwareDetokenizer


@dataclass
class GenerationStats:
    """What one call used, filled in as it runs (the chat model's usage metadata)."""

    prompt_tokens: int
    """New tokens run through the model for this call (role prompt, question, ...)."""
    cached_tokens: int
    """Tokens served from the pool instead of being prefilled again."""
    output_tokens: int = 0
    finish_reason: Literal["stop", "length"] | None = None
    """``stop``: EOS or a stop sequence; ``length``: the token budget ran out."""


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends a turn: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return frozenset(ids)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], *, pool: SharedKVPool | None
) -> torch.Tensor:
    """Token ids ``[n]`` of ``messages`` plus the generation prompt: as a continuation of the pool's
    prefix when there is a pool, else as a whole prompt."""
    if pool is not None:
        text = render_continuation(tokenizer, pool.prefix_messages, messages)
    else:
        text = render_prompt(tokenizer, messages)
    # The rendered template already holds its special tokens.
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


@torch.inference_mode()
def _forward_last(model: PreTrainedModel, ids: torch.Tensor, cache, start_position: int) -> torch.Tensor:
    logits = forward_with_cache(
        model, ids.to(model.device).unsqueeze(0), cache, start_position=start_position, logits_to_keep=1
    )
    return logits[0, -1]  # [vocab]


def generate_token_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: torch.Tensor,
    settings: GenerationSettings,
    *,
    pool: SharedKVPool | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Generated token ids (EOS excluded). Stop sequences act on text: see :func:`generate_text`.

    Raises:
        ValueError: The pool plus the prompt do not fit in the model's positions.
    """
    start = pool.num_tokens if pool is not None else 0
    limit = max_positions(model)
    if limit is not None and start + prompt_ids.numel() >= limit:
        msg = (
            f"the pool ({start} tokens) plus this prompt ({prompt_ids.numel()} tokens) exceeds the model's "
            f"{limit} positions; use a shorter document or prompt"
        )
        raise ValueError(msg)
    budget = settings.max_new_tokens
    if limit is not None:
        budget = min(budget, limit - start - prompt_ids.numel())
    if budget == 0:
        if stats is not None:
            stats.finish_reason = "length"
        return
    eos_ids = eos_token_ids(model, tokenizer)
    generator = settings.make_generator()
    with torch.inference_mode():
        cache = pool.to_cache(model) if pool is not None else new_dynamic_cache(model)
    logits = _forward_last(model, prompt_ids, cache, start)
    position = start + prompt_ids.numel()
    for step in range(budget):
        token = next_token(logits, settings, generator)
        if token in eos_ids:
            if stats is not None:
                stats.finish_reason = "stop"
            return
        if stats is not None:
            stats.output_tokens += 1
        yield token
        if step + 1 < budget:
            logits = _forward_last(model, torch.tensor([token]), cache, position)
            position += 1
    if stats is not None:
        stats.finish_reason = "length"


def generate_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: torch.Tensor,
    settings: GenerationSettings,
    *,
    pool: SharedKVPool | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[str]:
    """Text pieces as they are decoded, ending before the first stop sequence.

    Closing the iterator early (a consumer that stops reading, a cancelled request) closes the
    token loop too, which frees the call's cache at once.
    """
    detokenizer = StopAwareDetokenizer(tokenizer, settings.stop)
    tokens = generate_token_ids(model, tokenizer, prompt_ids, settings, pool=pool, stats=stats)
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
