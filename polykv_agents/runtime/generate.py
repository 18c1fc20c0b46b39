"""The decode path's entry points, shared by ``PooledAgent`` and ``ChatPolyKV``.

  DecodeRequest (prompt ids ``[n]`` after the pool's ``T`` tokens, settings, stats)
  -> token budget (``max_new_tokens``, capped by the model's positions)
  -> a :class:`~polykv_agents.runtime.backend.Backend` decodes it: token ids
  -> :func:`generate_text` turns them into text pieces and applies stop sequences.

A call never writes the pool: every backend decodes into caches of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from polykv_agents.runtime.backend import Backend
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.sampling.text_stream import StopAwareDetokenizer


def generate_token_ids(request: DecodeRequest, backend: Backend) -> Iterator[int]:
    """Generated token ids (EOS excluded). Stop sequences act on text: see :func:`generate_text`.

    Raises:
        ValueError: The pool plus the prompt do not fit in the model's positions.
    """
    stats = request.stats
    budget = request.token_budget()
    if budget == 0:
        stats.finish_reason = "length"
        return
    tokens = backend.decode(request, budget)
    try:
        for token in tokens:
            if stats.first_token_at is None:
                stats.first_token_at = time.monotonic()
            stats.output_tokens += 1
            yield token
    finally:
        stats.finished_at = time.monotonic()
        tokens.close()  # cancels a scheduled request / frees a private cache at once


def generate_text(request: DecodeRequest, backend: Backend) -> Iterator[str]:
    """Text pieces as they are decoded, ending before the first stop sequence.

    Closing the iterator early (a consumer that stops reading, a cancelled request) closes the
    token loop too, which frees the call's cache at once.
    """
    settings = request.settings
    # Under a grammar the grammar decides the end: a stop sequence inside a JSON string must not cut it.
    detokenizer = StopAwareDetokenizer(
        request.tokenizer, settings.text_stops, structured_opening=settings.structured_opening
    )
    tokens = generate_token_ids(request, backend)
    try:
        for token in tokens:
            piece = detokenizer.push(token)
            if piece:
                yield piece
            if detokenizer.stopped:
                request.stats.finish_reason = "stop"
                return
        tail = detokenizer.finish()
        if tail:
            yield tail
    finally:
        tokens.close()
