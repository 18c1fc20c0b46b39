"""Every difference between transformers versions that this package touches, in one place.

- transformers 5.24 renamed the forward/generate keyword ``past_key_values`` to ``cache`` (the old
  name warns and is due for removal), and the output attribute with it. We look at the model's own
  ``forward`` signature instead of the version string, so remote-code models that kept the old name
  keep working too.
- A cache is a list of per-layer objects with ``keys``/``values`` tensors shaped
  ``[batch, kv_heads, tokens, head_dim]``; older releases exposed ``key_cache``/``value_cache``
  lists instead. ``layer_key_values`` hides which one we got.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from polykv_agents.model.compute_thread import run_on_compute_thread


@functools.cache
def _cache_keyword_for(forward_owner: type) -> str:
    parameters = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword ``model.forward`` takes its KV cache under: ``cache`` (5.24+) or ``past_key_values``."""
    return _cache_keyword_for(type(model))


def new_dynamic_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty ``DynamicCache`` whose layer types (full or sliding) follow the model's config."""
    return DynamicCache(config=model.config)


def new_full_cache() -> DynamicCache:
    """An empty ``DynamicCache`` that keeps every token in every layer, sliding-window layers included.

    The window still holds: transformers' masks apply it to whatever the cache holds (prefill logits with it
    match a sliding cache's and a single forward's to float rounding, ``tests/unit/test_architectures.py``). A
    pool needs it because it holds every document token in every layer, however long the window.
    """
    return DynamicCache()


def forward_with_cache(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: Cache,
    *,
    start_position: int,
    logits_to_keep: int = 0,
    **kwargs: Any,
) -> torch.Tensor:
    """Run ``input_ids`` ``[1, n]`` on top of ``cache`` at absolute positions ``start_position ...``.

    Positions are passed explicitly rather than inferred from the cache length: with an externally
    built cache, inferred positions are the classic way to mis-place tokens silently.

    Runs on the process's compute thread (:mod:`polykv_agents.model.compute_thread`).

    Returns:
        Logits ``[1, n or logits_to_keep, vocab]``; ``cache`` is updated in place by the model.
    """
    return run_on_compute_thread(
        _forward_with_cache, model, input_ids, cache, start_position, logits_to_keep=logits_to_keep, **kwargs
    )


def _forward_with_cache(
    model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache, start_position: int, **kwargs: Any
) -> torch.Tensor:
    num_new = input_ids.shape[-1]
    position_ids = torch.arange(start_position, start_position + num_new, device=input_ids.device)
    outputs = model(
        input_ids=input_ids,
        position_ids=position_ids.unsqueeze(0),  # [1, n]
        use_cache=True,
        **{cache_keyword(model): cache},
        **kwargs,
    )
    return outputs.logits


def layer_key_values(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)``, each ``[batch, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:  # transformers < 4.56 kept two parallel lists
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    if any(k is None or v is None for k, v in pairs):
        msg = (
            "This model's cache has layers without key/value tensors (recurrent, hybrid or shared-KV "
            "layers). SharedKVPool supports attention caches only; use a decoder-only transformer."
        )
        raise TypeError(msg)
    return pairs


def cache_from_key_values(model: PreTrainedModel, key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A fresh ``DynamicCache`` holding ``key_values``; the cache's update concatenates, so the
    given tensors are never written to. The copies run on the compute thread: a concatenation this large
    is a parallel region."""
    return run_on_compute_thread(_cache_from_key_values, model, key_values)


def _cache_from_key_values(model: PreTrainedModel, key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = new_dynamic_cache(model)
    for layer_idx, (keys, values) in enumerate(key_values):
        cache.update(keys, values, layer_idx)
    return cache
