"""The private runtime: one call decodes alone, over a cache that only it holds.

  a cache of the call's own: the whole pool decoded into it (the reference design), or empty
  -> forward the prompt ``[n]`` at positions ``T .. T+n-1``
  -> one token at a time until EOS, the grammar's end or the token budget.

It serves calls without a pool, ``runtime="private"`` (a baseline for benchmarks), and models whose
attention the batched runtime does not implement
(:func:`~polykv_agents.model.architecture.unsupported_batched_attention`). A caller may prefill a pool-less
call's prompt its own way (``prefill=``): the repository's re-prefill baseline passes the pool's chunked
prefill, so that it prefills a document as the time-to-first-token baseline does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from polykv_agents.model.compat import forward_with_cache, new_dynamic_cache
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.sampling.settings import choose_token, eos_token_ids, repetition_history, token_constraint

PromptPrefill = Callable[[PreTrainedModel, torch.Tensor], tuple[Cache, torch.Tensor]]
"""Prefills a call's whole prompt ``[n]`` into a fresh cache: ``(cache, last_logits [vocab])``
(:func:`~polykv_agents.pool.prefill.prefill_cache` is one)."""


@torch.inference_mode()
def _forward_last(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, start_position: int) -> torch.Tensor:
    logits = forward_with_cache(
        model, ids.to(model.device).unsqueeze(0), cache, start_position=start_position, logits_to_keep=1
    )
    return logits[0, -1]  # [vocab]


def private_tokens(request: DecodeRequest, budget: int, *, prefill: PromptPrefill | None = None) -> Iterator[int]:
    """Token ids of ``request`` decoded over a cache of its own (EOS excluded); sets its finish reason.

    ``prefill``: how a call without a pool prefills its prompt (default: one forward into a cache whose layers
    follow the model's config); then decoding goes on over the cache it returns.
    """
    model, tokenizer, settings, stats = request.model, request.tokenizer, request.settings, request.stats
    if settings.reuse == "blocks":
        msg = "reuse='blocks' is served by the batched runtime only; call with reuse='exact', or another runtime"
        raise ValueError(msg)
    if prefill is not None and request.pool is not None:
        msg = "prefill= replaces the prefill of a call without a pool; this call reads a pool, so leave it out"
        raise ValueError(msg)
    with torch.inference_mode():
        cache = request.pool.to_cache(model) if request.pool is not None else new_dynamic_cache(model)
    eos_ids = eos_token_ids(model, tokenizer)
    generator = settings.make_generator()
    constraint = token_constraint(model, tokenizer, settings)
    history = repetition_history(settings, request.prompt_ids)

    def next_token(ids: torch.Tensor, position: int, remaining: int) -> tuple[int | None, str | None]:
        # Forward and sampling (a softmax over the vocabulary) together: one job on the compute thread per token.
        nonlocal cache
        if stats.started_at is None:  # the compute thread took this call's prompt: its queue ends here
            stats.started_at = time.monotonic()
        if prefill is not None and position == 0:  # the whole prompt, by the caller's prefill, into its cache
            cache, logits = prefill(model, ids)
        else:
            logits = _forward_last(model, ids, cache, position)
        chosen = choose_token(logits, settings, generator, constraint, eos_ids, history, stats.logprobs, remaining)
        if constraint is not None and constraint.closing:
            stats.grammar_closed = True
        return chosen

    ids, position = request.prompt_ids, request.start_position  # [n] at positions T .. T+n-1
    for step in range(budget):
        token, reason = run_on_compute_thread(next_token, ids, position, budget - step)
        if token is not None:
            yield token
        if reason is not None:
            stats.finish_reason = reason
            return
        position += ids.numel()
        ids = torch.tensor([token])
    stats.finish_reason = "length"
