"""Text that earlier calls over a pool ran through the model, kept with its keys and values, so that a later call
reading the same text at another position moves them there instead of prefilling it (``reuse="blocks"``).

The prefix tree (:mod:`.prefix_tree`) serves a call whose tokens *begin* with an earlier call's: exact. This store
serves text found anywhere: the specialists' findings pasted into the critic's prompt, a plan quoted by every
role, a passage retrieved twice. Each finished call's tokens (its prompt and its answer) are kept as one block:

  block: tokens b[0:n] computed at pool-relative offsets 0 .. n-1, keys and values per layer [KVH, n, D]
  a later prompt p: every maximal run p[j:j+k] == b[i:i+k] with k >= min_tokens is an occurrence
  -> the run's keys move by ``j - i`` positions (RoPE: :func:`~polykv_agents.model.rope.move_keys`)

This is an approximation: the moved tokens attended to what preceded them in the earlier call, not in this one.
The admission recomputes a fraction of each occurrence in its new context (:mod:`polykv_agents.pool.recompute`),
and never stores what it composed in the exact prefix tree. Blocks live under their own byte budget; beyond it
the least recently used go first.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel

from polykv_agents.model.rope import move_keys
from polykv_agents.runtime.prefix_tree import LayerKV

MIN_BLOCK_TOKENS = 16
"""Shortest run of tokens worth moving: shorter ones are chat-template markup and common phrases, cheaper to
prefill than to move and repair."""


@dataclass(eq=False)
class _Block:
    tokens: tuple[int, ...]
    layers: tuple[LayerKV, ...]  # per layer (keys, values) [KVH, n, D], token i computed at pool offset i
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


@dataclass(frozen=True)
class BlockOccurrence:
    """Tokens ``start .. start + length - 1`` of a prompt are a stored block's tokens ``offset ..``."""

    start: int
    length: int
    offset: int
    block: _Block

    @property
    def shift(self) -> int:
        """Positions the run moves by: where it is now minus where it was computed."""
        return self.start - self.offset

    def layer(self, layer_idx: int) -> LayerKV:
        """The run's stored keys and values ``[KVH, length, D]`` (as computed, not yet moved)."""
        keys, values = self.block.layers[layer_idx]
        return keys[:, self.offset : self.offset + self.length], values[:, self.offset : self.offset + self.length]


class BlockStore:
    """Blocks per (model, pool digest), under one byte budget. Every method is safe to call from any thread.

    Args:
        max_bytes: Budget for the keys and values of all blocks.
        min_tokens: Shortest run that counts as an occurrence.
    """

    def __init__(self, max_bytes: int, *, min_tokens: int = MIN_BLOCK_TOKENS) -> None:
        if max_bytes < 0:
            msg = f"max_bytes must be a non-negative number of bytes, got {max_bytes!r}"
            raise ValueError(msg)
        if min_tokens < 2:
            msg = f"min_tokens must be at least 2 (runs are found by token pairs), got {min_tokens!r}"
            raise ValueError(msg)
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._lock = threading.Lock()
        self._blocks: weakref.WeakKeyDictionary[PreTrainedModel, dict[str, list[_Block]]] = weakref.WeakKeyDictionary()
        self._clock = itertools.count(1)
        self.evictions = 0

    def __repr__(self) -> str:
        return f"BlockStore(nbytes={self.nbytes}, max_bytes={self.max_bytes}, evictions={self.evictions})"

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(
                block.nbytes for per_model in self._blocks.values() for blocks in per_model.values() for block in blocks
            )

    def add(self, model: PreTrainedModel, pool_digest: str, tokens: Sequence[int], layers: Sequence[LayerKV]) -> None:
        """Keep ``tokens`` (computed at pool offsets ``0 .. n-1``) with ``layers`` (per layer ``[KVH, n, D]``,
        copied), unless too short; then evict down to the budget."""
        if len(tokens) < self.min_tokens:
            return
        key = tuple(tokens)
        with self._lock:
            if any(old.tokens == key for old in self._blocks.get(model, {}).get(pool_digest, ())):
                return
        block = _Block(key, tuple((k.clone(), v.clone()) for k, v in layers))  # outside the lock: MBs of copying
        with self._lock:
            blocks = self._blocks.setdefault(model, {}).setdefault(pool_digest, [])
            if any(old.tokens == key for old in blocks):
                return
            block.last_used = next(self._clock)
            blocks.append(block)
            self._evict_over_budget()

    def find(
        self, model: PreTrainedModel, pool_digest: str, tokens: Sequence[int], start: int, end: int
    ) -> list[BlockOccurrence]:
        """Occurrences of stored blocks in ``tokens[start:end]``, left to right, none overlapping: at each position
        the longest run any block has there (at least ``min_tokens``)."""
        with self._lock:
            blocks = list(self._blocks.get(model, {}).get(pool_digest, ()))
            tick = next(self._clock)
        if not blocks or end - start < self.min_tokens:
            return []
        pairs: dict[tuple[int, int], list[tuple[_Block, int]]] = {}
        for block in blocks:
            for i in range(len(block.tokens) - 1):
                pairs.setdefault((block.tokens[i], block.tokens[i + 1]), []).append((block, i))
        found, j = [], start
        while j < end - 1:
            best: BlockOccurrence | None = None
            for block, i in pairs.get((tokens[j], tokens[j + 1]), ()):
                length = _run_length(tokens, j, end, block.tokens, i)
                if length >= self.min_tokens and (best is None or length > best.length):
                    best = BlockOccurrence(j, length, i, block)
            if best is None:
                j += 1
                continue
            best.block.last_used = tick
            found.append(best)
            j += best.length
        return found

    def _evict_over_budget(self) -> None:
        every = [
            (block.last_used, blocks, block)
            for per_model in self._blocks.values()
            for blocks in per_model.values()
            for block in blocks
        ]
        total = sum(block.nbytes for *_, block in every)
        for _, blocks, block in sorted(every, key=lambda entry: entry[0]):
            if total <= self.max_bytes:
                break
            blocks.remove(block)
            total -= block.nbytes
            self.evictions += 1


def _run_length(tokens: Sequence[int], j: int, end: int, block: Sequence[int], i: int) -> int:
    """How many tokens ``tokens[j:end]`` and ``block[i:]`` share from their starts."""
    length = 0
    while j + length < end and i + length < len(block) and tokens[j + length] == block[i + length]:
        length += 1
    return length


def moved_layer(model: PreTrainedModel, occurrence: BlockOccurrence, layer_idx: int) -> LayerKV:
    """The occurrence's keys moved to where it now sits (values as stored), ``[KVH, length, D]`` each."""
    keys, values = occurrence.layer(layer_idx)
    return move_keys(model, keys.unsqueeze(0), occurrence.shift)[0], values
