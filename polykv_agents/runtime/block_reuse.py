"""A call's start composed from stored blocks (``reuse="blocks"``): what its admission loads instead of prefilling.

For a prompt ``p[0:n]`` over a pool of ``T`` tokens, with an exact stored start ``p[0:m]`` (the prefix tree's) and
block occurrences in ``p[m:n-1]`` (:class:`~polykv_agents.runtime.block_store.BlockStore`), the last ending at
``e``:

  one cache of full-attention layers, per layer [1, KVH, T + e, D]:
    [pool: decoded prefix][p[0:m]: exact, stored][p[m:e]: each occurrence's keys moved to its slots, zeros elsewhere]
  -> recompute in place (:func:`~polykv_agents.pool.recompute.recompute_in_place`): every token between the
     occurrences (never computed in this context) and the first ``ceil(recompute * k)`` tokens of each
     occurrence of ``k`` tokens (EPIC's choice: a block's first tokens carry what it attended to before)
  -> the row's start ``p[0:e]``: its keys and values per layer [KVH, e, D], loaded like a prefix-tree match.

Tokens before the first occurrence are exact (they see only exact tokens), so the row is exact up to
:attr:`ComposedStart.exact_length`; only that part may ever be stored as exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from polykv_agents.pool.recompute import recompute_in_place, recomputed_head
from polykv_agents.runtime.block_store import BlockOccurrence, moved_layer
from polykv_agents.runtime.prefix_tree import LayerKV, PrefixMatch
from polykv_agents.runtime.shared_prefix import SharedPrefix


@dataclass
class ComposedStart:
    """The first ``length`` prompt tokens' keys and values, partly moved from blocks (read like a
    :class:`~polykv_agents.runtime.prefix_tree.PrefixMatch`)."""

    length: int
    layers: list[LayerKV]  # per layer [KVH, length, D]
    stored_length: int
    """Tokens from the start read from the prefix tree (exact, stored by earlier calls)."""
    exact_length: int
    """Tokens from the start that are exact: up to the first occurrence."""
    moved: list[int]
    """Prompt indices whose keys and values were moved and kept (not recomputed)."""
    evicted_tokens: int = 0

    def layer(self, layer_idx: int, length: int | None = None) -> LayerKV:
        keys, values = self.layers[layer_idx]
        wanted = self.length if length is None else length
        return keys[:, :wanted], values[:, :wanted]

    def moved_before(self, length: int) -> int:
        """Moved tokens among the first ``length``: what a row that reads ``length`` of them reuses from blocks."""
        return sum(1 for index in self.moved if index < length)

    def reused_before(self, length: int) -> int:
        """Tokens among the first ``length`` that were read, not computed: stored exact ones and moved ones."""
        return min(length, self.stored_length) + self.moved_before(length)


@torch.inference_mode()
def compose_start(
    model: PreTrainedModel,
    prefix: SharedPrefix,
    match: PrefixMatch,
    tokens: Sequence[int],
    occurrences: Sequence[BlockOccurrence],
    recompute: float,
) -> ComposedStart:
    """``tokens[0:e]`` of a prompt composed as the module docstring says (``occurrences`` sorted, past ``match``)."""
    pool_tokens, exact = prefix.num_tokens, match.length
    end = occurrences[-1].start + occurrences[-1].length
    kept: list[int] = []
    computed = list(range(exact, occurrences[0].start))
    for occurrence, after in zip(occurrences, [*occurrences[1:], None], strict=True):
        head = recomputed_head(occurrence.length, recompute)
        computed += range(occurrence.start, occurrence.start + head)
        kept += range(occurrence.start + head, occurrence.start + occurrence.length)
        computed += range(occurrence.start + occurrence.length, end if after is None else after.start)
    cache = DynamicCache()
    for layer_idx in range(prefix.pool.num_layers):
        prefix_keys, prefix_values = prefix.layer(layer_idx)  # [1, KVH, T, D]
        keys = prefix_keys.new_zeros(*prefix_keys.shape[:2], pool_tokens + end, prefix_keys.shape[3])
        values = prefix_values.new_zeros(*prefix_values.shape[:2], pool_tokens + end, prefix_values.shape[3])
        keys[:, :, :pool_tokens], values[:, :, :pool_tokens] = prefix_keys, prefix_values
        if exact:
            stored_keys, stored_values = match.layer(layer_idx, exact)
            keys[0, :, pool_tokens : pool_tokens + exact] = stored_keys
            values[0, :, pool_tokens : pool_tokens + exact] = stored_values
        for occurrence in occurrences:
            at = slice(pool_tokens + occurrence.start, pool_tokens + occurrence.start + occurrence.length)
            keys[0, :, at], values[0, :, at] = moved_layer(model, occurrence, layer_idx)
        cache.update(keys, values, layer_idx)
    recomputed = torch.tensor(sorted(computed), dtype=torch.long)
    ids = torch.tensor(list(tokens), dtype=torch.long)[recomputed]
    recompute_in_place(model, cache, ids, recomputed + pool_tokens)
    layers = [(layer.keys[0, :, pool_tokens:], layer.values[0, :, pool_tokens:]) for layer in cache.layers]
    return ComposedStart(end, layers, exact, occurrences[0].start, kept, match.evicted_tokens)
