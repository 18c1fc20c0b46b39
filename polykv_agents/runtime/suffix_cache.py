"""The per-agent half of the runtime's KV cache: each agent's own tokens, batched, never the prefix.

A :class:`SuffixCache` holds, per layer, keys and values ``[B, kv_heads, capacity, head_dim]``:
row r's slots ``starts[r] .. lengths[r] - 1`` are agent r's suffix (slots before ``starts[r]`` hold
left padding from a batched admission) (its role prompt, question and
generated tokens). A forward writes this step's ``q`` new tokens of every row at its own offset;
:meth:`advance` then commits them. Rows join (:meth:`concat`) and leave (:meth:`select`) between
steps. The shared prefix is never stored here: cascade attention reads it from the SharedPrefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_GROWTH = 16
"""Slots added at a time when a row outgrows the cache."""


class _SuffixLayer(CacheLayerMixin):
    """One layer's padded suffix keys/values."""

    is_sliding = False

    def __init__(self, owner: SuffixCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        shape = (batch, kv_heads, self._owner.capacity, head_dim)
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros(shape)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B, KVH, q, D]`` at each row's offset; return keys/values up to the longest row."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        needed, index = self._owner.write_plan(key_states.shape, self.keys.device)
        if needed > self.keys.shape[-2]:
            self._grow(needed)
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        rows = key_states.shape[0]  # a compiled step may have left padding rows after them (reserve)
        return self.keys[:rows, :, :needed], self.values[:rows, :, :needed]

    def _grow(self, needed: int) -> None:
        # Grow in small steps, not by doubling: suffixes are short, and spare capacity is KV memory
        # held for every row of the batch.
        self.reserve(self.keys.shape[0], -(-needed // _GROWTH) * _GROWTH)

    def reserve(self, rows: int, capacity: int) -> None:
        """Pad the tensors to at least ``rows`` rows and ``capacity`` slots (new ones are zeros)."""
        pad_rows, pad_slots = max(0, rows - self.keys.shape[0]), max(0, capacity - self.keys.shape[-2])
        if pad_rows or pad_slots:
            self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, pad_slots, 0, 0, 0, pad_rows))
            self.values = torch.nn.functional.pad(self.values, (0, 0, 0, pad_slots, 0, 0, 0, pad_rows))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self._owner.lengths.max()) + query_length, 0

    def get_seq_length(self) -> int:
        return int(self._owner.lengths.max()) if self._owner.lengths.numel() else 0

    def get_max_length(self) -> int:
        return -1


class SuffixCache(Cache):
    """Batched per-agent suffixes for all decoder layers."""

    def __init__(self, num_layers: int, batch_size: int, *, capacity: int = _GROWTH) -> None:
        self._initial_capacity = capacity
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # [B] slots filled per row
        self.starts = torch.zeros(batch_size, dtype=torch.long)  # [B] leading slots of left padding
        self._plan: tuple | None = None  # this step's write_plan, dropped whenever the rows change
        super().__init__(layers=[_SuffixLayer(self) for _ in range(num_layers)])

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    @property
    def capacity(self) -> int:
        """Slots each row has room for (the widest layer's)."""
        return self._width()

    def reserve(self, rows: int, capacity: int) -> None:
        """Pad every layer to at least ``rows`` rows and ``capacity`` slots, so that a compiled step sees
        the shapes it was built for; rows past :attr:`batch_size` are padding that no row reads."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.reserve(rows, capacity)

    def load_row(self, row: int, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill row ``row``'s first slots with stored keys and values (per layer ``[KVH, m, D]``, e.g. a
        :class:`~polykv_agents.runtime.prefix_tree.PrefixMatch`'s) and count them as filled: its next tokens go
        after them. Call before any forward over this cache; layers not yet made are made here."""
        for layer, (keys, values) in zip(self.layers, layers, strict=True):
            if not layer.is_initialized:
                shape = (self.batch_size, keys.shape[0], 0, keys.shape[2])  # [B, KVH, 0, D]; the slots: capacity
                layer.lazy_initialization(keys.new_empty(shape), values.new_empty(shape))
            length = keys.shape[1]
            if length > layer.keys.shape[-2]:
                layer.reserve(self.batch_size, length)
            layer.keys[row, :, :length] = keys
            layer.values[row, :, :length] = values
        self.lengths[row] = layers[0][0].shape[1] if layers else 0
        self._plan = None

    def write_plan(self, shape: torch.Size, device: torch.device) -> tuple[int, torch.Tensor]:
        """``(slots needed, scatter index [B, KVH, q, D])`` for this step's new tokens ``shape``.

        The same for every layer of one forward, so it is built once per step, not once per layer.
        """
        if self._plan is None or self._plan[0] != (tuple(shape), device):
            batch, kv_heads, q_len, head_dim = shape
            slots = (self.lengths.view(-1, 1) + torch.arange(q_len)).to(device)  # [B, q]
            index = slots.view(batch, 1, q_len, 1).expand(-1, kv_heads, -1, head_dim)
            self._plan = ((tuple(shape), device), int(self.lengths.max()) + q_len, index)
        return self._plan[1], self._plan[2]

    def advance(self, q_len: int) -> None:
        """Commit the ``q_len`` tokens the last forward wrote to every row."""
        self.lengths += q_len
        self._plan = None

    @property
    def nbytes(self) -> int:
        """Bytes allocated for all rows' suffixes (padding and spare capacity included)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (a long tensor of row indices), in that order."""
        self.lengths, self.starts = self.lengths[rows], self.starts[rows]
        self._plan = None
        for layer in self.layers:
            if layer.is_initialized:
                index = rows.to(layer.keys.device)
                layer.keys, layer.values = layer.keys[index], layer.values[index]

    def concat(self, other: SuffixCache) -> None:
        """Append ``other``'s rows after this cache's rows."""
        width = max(self._width(), other._width())
        rows, their_rows = self.batch_size, other.batch_size  # both may hold padding rows after theirs
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if not theirs.is_initialized:
                continue
            if not mine.is_initialized:
                mine.keys, mine.values = theirs.keys[:0], theirs.values[:0]  # no rows yet
                mine.device, mine.is_initialized = theirs.device, True
            mine.keys = torch.cat([_fit(mine.keys[:rows], width), _fit(theirs.keys[:their_rows], width)])
            mine.values = torch.cat([_fit(mine.values[:rows], width), _fit(theirs.values[:their_rows], width)])
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.starts = torch.cat([self.starts, other.starts])
        self._plan = None

    def _width(self) -> int:
        initialized = [layer.keys.shape[-2] for layer in self.layers if layer.is_initialized]
        return max(initialized, default=self._initial_capacity)


def _fit(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad (or keep) dimension 2 to ``width`` positions."""
    return torch.nn.functional.pad(tensor, (0, 0, 0, width - tensor.shape[-2]))
