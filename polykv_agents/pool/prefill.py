"""Chunked prefill: run a model over token ids once and return its full-precision KV cache.

Chunking bounds the attention scores to ``[chunk, T]`` instead of ``[T, T]``, and keeping only
the last position's logits avoids a ``[T, vocab]`` tensor that would dwarf the cache itself. The
cache still grows to the whole document: that is what gets compressed. Each layer's keys and values are
reserved at the document's length before the first chunk is written
(:class:`~polykv_agents.model.compat.ReservedLayer`), never grown by copying. The heap the chunks' activations
leave free is handed back by whoever keeps the process going: a pool's build does it after each layer it
compresses (:mod:`~polykv_agents.pool.shared_pool`), outside the prefill that TTFT figures time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from polykv_agents.model.compat import forward_with_cache, new_full_cache

DEFAULT_CHUNK_SIZE = 512
"""Tokens per forward pass during prefill."""


@torch.inference_mode()
def prefill_cache(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[DynamicCache, torch.Tensor]:
    """Prefill ``token_ids [T]`` into a fresh cache.

    Returns:
        ``(cache, last_logits)``: the cache holds layers ``[1, kv_heads, T, head_dim]``, all ``T`` tokens in
        every layer, sliding-window layers included;
        ``last_logits [vocab]`` predict the token after the document.
    """
    if chunk_size < 1:
        msg = f"chunk_size must be a positive number of tokens, got {chunk_size}"
        raise ValueError(msg)
    ids = token_ids.to(model.device).unsqueeze(0)  # [1, T]
    num_tokens = ids.shape[-1]
    # Every token in every layer, sliding-window layers included (their masks apply it), reserved at its full size.
    cache = new_full_cache(capacity=num_tokens)
    logits = None
    for start in range(0, num_tokens, chunk_size):
        logits = forward_with_cache(
            model, ids[:, start : start + chunk_size], cache, start_position=start, logits_to_keep=1
        )
        if progress is not None:
            progress(min(start + chunk_size, num_tokens), num_tokens)
    assert logits is not None, "token_ids must not be empty"
    return cache, logits[0, -1]
