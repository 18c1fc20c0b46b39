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
from transformers.cache_utils import Cache, DynamicLayer

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


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer that writes its keys and values into buffers reserved for ``capacity`` tokens,
    ``[batch, kv_heads, capacity, head_dim]`` each, and reads them as views ``[..., :length, :]``.

    ``DynamicLayer`` grows by concatenation: each chunk of a prefill copies the whole layer so far into a new, larger
    block. The blocks it leaves are freed in sizes the next, larger one cannot reuse, and glibc keeps them in the
    RSS: a prefill of 8,192 tokens on Llama-3.2-1B held 764 MiB more after it than before, for a 256 MiB cache, and
    291 MiB reserved (``python -m benchmarks.probes.load_memory``, ``benchmarks/results/issue43``). Reserved, the
    cache is allocated once, at its final size.
    Past ``capacity``, or once its keys are no longer a view of the buffers (a batch repeated or selected), the
    layer grows by concatenation as ``DynamicLayer`` does.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[-1])
        self.value_buffer = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[-1])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        in_buffers = start == 0 or self.keys.data_ptr() == self.key_buffer.data_ptr()  # a crop keeps the start
        fits = end <= self.capacity and key_states.shape[:2] == self.key_buffer.shape[:2]
        if not (in_buffers and fits):
            return super().update(key_states, value_states, *args, **kwargs)
        self.key_buffer[..., start:end, :] = key_states
        self.value_buffer[..., start:end, :] = value_states
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values


def new_full_cache(capacity: int | None = None) -> DynamicCache:
    """An empty ``DynamicCache`` that keeps every token in every layer, sliding-window layers included; with
    ``capacity``, each layer reserves that many tokens at its first write (:class:`ReservedLayer`).

    The window still holds: transformers' masks apply it to whatever the cache holds (prefill logits with it
    match a sliding cache's and a single forward's to float rounding, ``tests/unit/test_architectures.py``). A
    pool needs it because it holds every document token in every layer, however long the window.
    """
    cache = DynamicCache()
    if capacity is not None:
        cache.layer_class_to_replicate = functools.partial(ReservedLayer, capacity)
    return cache


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
