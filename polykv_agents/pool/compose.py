"""Multi-document pools: the pools of several documents composed at run time, in any order, none prefilled again.

Each pool was prefilled alone, its tokens at positions ``0 .. n_j - 1``. Composing ``[A, B, C]``:

  per layer: A's keys and values as they are | B's keys moved by ``n_A`` positions | C's by ``n_A + n_B``
  (decoded from each pool's codes, keys re-rotated: :func:`~polykv_agents.model.rope.move_keys`)
  -> recompute the first ``recompute`` fraction of every part after the first, in the composed context
     (:func:`~polykv_agents.pool.recompute.recompute_in_place`)
  -> compressed again with the pool codecs into one :class:`SharedKVPool` of ``n_A + n_B + n_C`` tokens.

This is an approximation, and :attr:`SharedKVPool.composition` says so: B's tokens attended to B alone when they
were computed, not to A. Its digest is not the digest of a pool prefilled from the same tokens, so nothing exact
(a prefix tree, a registry entry) is ever shared between the two. How much quality it costs at each recompute
fraction, against a full prefill of the same tokens, is measured by ``benchmarks/probes/compose_pools.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.config import CompressionConfig
from polykv_agents.model.architecture import check_causal_lm
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.model.rope import move_keys, rotary_embedding
from polykv_agents.pool.documents import check_fits_model
from polykv_agents.pool.recompute import recompute_in_place, recomputed_head
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.prompting.chat_template import render_messages

DEFAULT_RECOMPUTE = 0.05
"""Fraction of each later part recomputed by default (its first tokens). Measured by
``benchmarks/probes/compose_pools.py`` (two 1,024-token pydoc documents, 10 pairs, bf16): none recomputed cost
+1.78% perplexity on the second document's continuation (median; up to +4.4%), 2% and 5% cost +0.2% (up to
+2.6%), within the spread of a full recompute (-0.6%, -1.2% to +1.2%), at 0.6-0.7 s against 3.8 s for one
prefill of both."""


class Composition(BaseModel):
    """How a composed pool was made: part of its digest and of its file, so that it is never taken for exact."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parts: tuple[str, ...]
    """Digests of the composed pools, in order."""
    part_tokens: tuple[int, ...]
    """Tokens of each part, in order."""
    recompute: float = Field(ge=0.0, le=1.0)
    """Fraction of each part after the first whose tokens were recomputed (its first tokens)."""


def compose_pools(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pools: Sequence[SharedKVPool],
    *,
    recompute: float = DEFAULT_RECOMPUTE,
    config: CompressionConfig | None = None,
) -> SharedKVPool:
    """One pool reading ``pools``' documents one after the other, none of them prefilled again.

    Args:
        model: The model every pool was built with.
        tokenizer: Its tokenizer.
        pools: At least two pools, in the order their documents should be read.
        recompute: Fraction of each part after the first to run through the model again in its new context (its
            first ``ceil(recompute * n)`` tokens, as EPIC does); ``1.0`` is a full prefill of those parts.
        config: Compression of the composed pool; ``None``: the first pool's.

    Raises:
        ValueError: Fewer than two pools, a pool from another model or tokenizer, pools of mixed kinds (chat
            messages and plain text), a model whose positions cannot be moved, or more tokens than the model's
            positions or sliding window hold. All before any model work.
    """
    check_causal_lm(model)
    pools = list(pools)
    if len(pools) < 2:
        msg = f"compose_pools needs at least two pools, got {len(pools)}; a single pool is already what it reads"
        raise ValueError(msg)
    if not 0.0 <= recompute <= 1.0:
        msg = f"recompute must be a fraction between 0 and 1, got {recompute!r}"
        raise ValueError(msg)
    for i, pool in enumerate(pools):
        if not isinstance(pool, SharedKVPool):
            msg = f"pools[{i}] must be a SharedKVPool, got {type(pool).__name__}"
            raise TypeError(msg)
        try:
            pool.check_compatible(model, tokenizer)
        except ValueError as e:
            msg = f"pools[{i}] was built with another model or tokenizer: {e}"
            raise ValueError(msg) from e
    rotary_embedding(model)  # refuses models whose positions cannot be moved
    token_ids = torch.cat([pool.token_ids for pool in pools])  # [sum n_j]
    check_fits_model(
        model,
        token_ids.numel(),
        subject="the composed pools hold",
        remedy="compose fewer or shorter documents",
        within_window=True,
    )
    messages = _composed_messages(tokenizer, pools, token_ids)
    starts = _part_starts(pools)
    cache = run_on_compute_thread(_moved_cache, model, pools, starts)
    positions = torch.cat([
        torch.arange(start, start + recomputed_head(pool.num_tokens, recompute))
        for start, pool in zip(starts[1:], pools[1:], strict=True)
    ])  # fmt: skip
    run_on_compute_thread(recompute_in_place, model, cache, token_ids[positions], positions)
    composition = Composition(
        parts=tuple(pool.digest for pool in pools),
        part_tokens=tuple(pool.num_tokens for pool in pools),
        recompute=recompute,
    )
    return SharedKVPool.from_cache(
        model,
        tokenizer,
        cache,
        token_ids,
        config=pools[0].config if config is None else config,
        prefix_messages=messages,
        composition=composition,
    )


def _part_starts(pools: Sequence[SharedKVPool]) -> list[int]:
    """Where each part starts in the composed pool: ``[0, n_0, n_0 + n_1, ...]``."""
    starts, total = [], 0
    for pool in pools:
        starts.append(total)
        total += pool.num_tokens
    return starts


def _composed_messages(
    tokenizer: PreTrainedTokenizerBase, pools: Sequence[SharedKVPool], token_ids: torch.Tensor
) -> list[dict[str, str]] | None:
    """The composed pool's chat messages: every pool's, in order (``None`` when every pool is plain text).

    A chat template may render messages differently together than apart (a default system turn, a date line);
    then the composed tokens would not be the conversation agents' turns are rendered after, so it is refused.
    """
    kinds = {pool.prefix_messages is None for pool in pools}
    if kinds == {True}:
        return None
    if len(kinds) > 1:
        msg = (
            "the pools mix chat-message documents and plain-text documents; compose pools of one kind "
            "(prefill the plain-text documents as messages, or the messages as text)"
        )
        raise ValueError(msg)
    messages = [dict(m) for pool in pools for m in pool.prefix_messages]
    rendered = tokenizer(render_messages(tokenizer, messages), add_special_tokens=False).input_ids
    if rendered != token_ids.tolist():
        msg = (
            "this chat template renders the pools' messages differently together than one by one, so agents' turns "
            "would follow tokens the composed pool does not hold; compose plain-text pools instead, or prefill the "
            "messages together as one document"
        )
        raise ValueError(msg)
    return messages


@torch.inference_mode()
def _moved_cache(model: PreTrainedModel, pools: Sequence[SharedKVPool], starts: Sequence[int]) -> DynamicCache:
    """Every pool decoded, each one's keys moved to where it now starts; ``[1, KVH, sum n_j, D]`` per layer.

    A cache of full-attention layers: the composed tokens fit the sliding window (checked), so a sliding layer's
    cache would hold the same tokens, and recomputing needs every slot to stay where it is.
    """
    cache = DynamicCache()
    for layer in range(pools[0].num_layers):
        keys, values = [], []
        for pool, start in zip(pools, starts, strict=True):
            k, v = pool.decompress_layer(layer, dtype=model.dtype, device=model.device)
            keys.append(move_keys(model, k, start) if start else k)
            values.append(v)
        cache.update(torch.cat(keys, dim=2), torch.cat(values, dim=2), layer)
    return cache
