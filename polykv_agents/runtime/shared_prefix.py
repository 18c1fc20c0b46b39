"""The document prefix as every concurrent agent reads it at run time: one copy, never per agent.

Residency is a choice between speed and memory, measured by ``polykv-agents bench agents``:

- ``decompressed``: every layer is decoded from the pool once, in the model's dtype, and kept. All
  agents read those tensors; nothing is copied per agent or per step.
- ``compressed``: only the pool stays resident. Where the native kernel runs and the pool's codecs have a stored
  form (int8 keys, TurboQuant values: the default; :mod:`polykv_agents.runtime.stored_prefix`), attention reads
  the pool's bytes as they are and no layer is ever decoded. Elsewhere a layer is decoded when attention needs
  it and dropped right after, so at most one decoded layer exists at a time, whatever the agent count.
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers import PreTrainedModel

from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.stored_prefix import StoredLayer, stored_layers

Residency = Literal["decompressed", "compressed"]


class SharedPrefix:
    """Read-only per-layer prefix keys and values ``[1, kv_heads, T, head_dim]`` for a pool."""

    def __init__(self, pool: SharedKVPool, model: PreTrainedModel, residency: Residency = "decompressed") -> None:
        if residency not in ("decompressed", "compressed"):
            msg = f"residency must be 'decompressed' or 'compressed', got {residency!r}"
            raise ValueError(msg)
        self.pool = pool
        self.residency: Residency = residency
        self.dtype = model.dtype
        self.device = model.device
        self._layers: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
        self._stored: tuple[StoredLayer, ...] | None = stored_layers(pool) if residency == "compressed" else None
        self._peak_transient_nbytes = 0
        if residency == "decompressed":
            with torch.inference_mode():
                self._layers = tuple(
                    pool.decompress_layer(i, dtype=self.dtype, device=self.device) for i in range(pool.num_layers)
                )

    @property
    def num_tokens(self) -> int:
        return self.pool.num_tokens

    @property
    def resident_nbytes(self) -> int:
        """Bytes held for the prefix besides the pool itself: the decoded layers, or when kept compressed the
        stored layers' float key scales, codebooks and rotations (a few KiB per layer)."""
        if self._layers is None:
            extra = {t.data_ptr(): t.nbytes for layer in self._stored or () for t in layer.extra_tensors()}
            return sum(extra.values())  # a codebook or rotation that layers share, once
        return sum(k.nbytes + v.nbytes for k, v in self._layers)

    @property
    def peak_held_nbytes(self) -> int:
        """Most bytes held for the prefix besides the pool at once: all decoded layers when kept decompressed;
        when kept compressed, :attr:`resident_nbytes` plus the largest layer decoded on the fly (measured as layers
        are decoded; none where the kernel reads every layer as stored)."""
        return self.resident_nbytes + (self._peak_transient_nbytes if self._layers is None else 0)

    def stored(self, layer_idx: int) -> StoredLayer | None:
        """Layer ``layer_idx`` as the pool stores it, for the native kernel; ``None`` unless kept compressed in
        codecs that have a stored form."""
        return None if self._stored is None else self._stored[layer_idx]

    def layers(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Every layer's keys and values when kept decoded; ``()`` when kept compressed."""
        return self._layers or ()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer; callers only read them."""
        if self._layers is not None:
            return self._layers[layer_idx]
        keys, values = self.pool.decompress_layer(layer_idx, dtype=self.dtype, device=self.device)
        self._peak_transient_nbytes = max(self._peak_transient_nbytes, keys.nbytes + values.nbytes)
        return keys, values
