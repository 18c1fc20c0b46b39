"""Recomputing chosen tokens of a cache in place: the repair step of reusing keys and values at other positions.

Keys and values moved from another context (:mod:`polykv_agents.model.rope`) are what those tokens computed
while attending to *that* context. CacheBlend and EPIC repair this by running a few of them through the model
again, in the new context, and keeping the rest as moved. One forward does it for any set of positions:

  cache  [1, KVH, L, D]  every position's keys and values (moved ones included)
  queries: the chosen tokens ``[q]`` at their own positions
  mask  [1, 1, q, L + q]: query i sees the cache's entries before its position, except the stale entries of the
        chosen tokens, and the chosen tokens up to itself (their new keys and values, layer by layer)
  -> their new keys and values overwrite the stale ones; the cache keeps its length ``L``.

At every layer a chosen token reads its own recomputed hidden state and the others' moved keys and values, as in
CacheBlend's selective recompute. Choosing every position is a full prefill in one forward (tested).
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from polykv_agents.model.compat import cache_keyword


def recomputed_head(length: int, fraction: float) -> int:
    """How many first tokens of a moved run of ``length`` tokens are recomputed at ``fraction`` (EPIC's choice:
    a run's first tokens carry most of what it attended to where it was computed)."""
    return math.ceil(fraction * length)


@torch.inference_mode()
def recompute_in_place(model: PreTrainedModel, cache: Cache, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Run ``token_ids [q]`` at ``positions [q]`` (sorted, each ``< L``) against ``cache`` (one row, length ``L``)
    and write their new keys and values over the old ones at those positions.

    ``cache`` must be a ``DynamicCache`` of full-attention layers: a sliding-window layer drops its oldest slots
    as the recomputed tokens are appended, and every slot must stay where it is.
    """
    if not all(isinstance(layer, DynamicLayer) and not layer.is_sliding for layer in cache.layers):
        msg = "recompute_in_place needs a DynamicCache of full-attention layers (DynamicCache() without a config)"
        raise TypeError(msg)
    if positions.numel() == 0:
        return
    length, count = cache.get_seq_length(), positions.numel()
    at = positions.to(model.device)
    earlier = torch.arange(length, device=model.device).unsqueeze(0) < at.unsqueeze(1)  # [q, L]
    earlier[:, at] = False  # the stale entries of the tokens being recomputed
    chosen = at.unsqueeze(0) <= at.unsqueeze(1)  # [q, q]
    allowed = torch.cat([earlier, chosen], dim=1).view(1, 1, count, length + count)
    # Additive, in the model's dtype: eager attention adds the mask, SDPA accepts it as well.
    mask = torch.zeros(allowed.shape, dtype=model.dtype, device=model.device)
    mask.masked_fill_(~allowed, torch.finfo(model.dtype).min)
    model(
        input_ids=token_ids.to(model.device).view(1, -1),
        position_ids=at.view(1, -1),
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword(model): cache},
    )
    for layer in cache.layers:
        new_keys, new_values = layer.keys[:, :, length:].clone(), layer.values[:, :, length:].clone()
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
        layer.keys[:, :, at] = new_keys
        layer.values[:, :, at] = new_values
