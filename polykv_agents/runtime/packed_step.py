"""One forward for the running rows' decode step and an admission's next chunk together (a mixed batch).

While rows decode and a new prompt is being admitted in chunks, the scheduler has two pieces of work per step:
one token for each of the ``B`` running rows, and the next ``c`` prompt tokens for each of the ``A`` rows being
admitted. Run as two forwards, every weight is read twice and every one of the model's ~1,000 small operations
is paid twice. Packed, they are one forward over one flat sequence of ``B + A*c`` tokens:

  input_ids / position_ids  [1, B + A*c]   the running rows' last tokens, then each admitted row's chunk
  every linear layer        runs once over all of them (what a step of a small model on a CPU spends most on)
  attention                 splits the flat queries back into the two groups, ``[B, H, 1, D]`` and
                            ``[A, H, c, D]``, each against the shared prefix and its own suffix cache
                            (:func:`~polykv_agents.runtime.cascade_attention.cascade_attention_forward` per group)
  logits                    only at each running row's token and each admitted row's last chunk token

Each group keeps its own :class:`~polykv_agents.runtime.suffix_cache.SuffixCache` and
:class:`~polykv_agents.runtime.cascade_attention.CascadeContext`, so every row sees exactly what it sees in
its own forward: packing changes which operations run together, not what any row attends to.
:func:`pack_parts` builds the flat inputs and the cascade of one such step (of one pool, or of several pools'
parts: :mod:`.model_steps`); the scheduler runs the forward, advances the caches and samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from polykv_agents.runtime.suffix_cache import SuffixCache

if TYPE_CHECKING:  # for annotations only: cascade_attention imports this module
    from polykv_agents.runtime.cascade_attention import CascadeContext


@dataclass(frozen=True)
class PackedGroup:
    """One group of rows in a packed forward: ``rows`` rows of ``width`` tokens each, over ``cache``."""

    rows: int
    width: int
    cache: SuffixCache
    context: object  # its CascadeContext (not imported: cascade_attention imports this module)

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    def unflatten(self, flat: torch.Tensor) -> torch.Tensor:
        """``[1, X, tokens, D]`` (heads first, this group's slice of the flat sequence) -> ``[rows, X, width, D]``."""
        heads, dim = flat.shape[1], flat.shape[-1]
        return flat[0].view(heads, self.rows, self.width, dim).transpose(0, 1)


class PackedCascade:
    """The cascade context of a packed forward: its groups in the order of the flat sequence.

    Passed as the model's ``cascade`` keyword; cascade attention then runs for each group (in one native call
    where it can: :mod:`.grouped_attention`) and puts the groups' outputs back in sequence order.
    """

    def __init__(self, groups: list[PackedGroup]) -> None:
        self.groups = groups
        self.cache = _PackedCache(self)

    @property
    def tokens(self) -> int:
        return sum(group.tokens for group in self.groups)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``[1, X, B + A*c, D]`` -> per group ``[rows, X, width, D]`` (queries, keys or values)."""
        parts = flat.split([group.tokens for group in self.groups], dim=2)
        return [group.unflatten(part) for group, part in zip(self.groups, parts, strict=True)]

    def kept_positions(self) -> torch.Tensor:
        """Indices into the flat sequence of each group's rows' last tokens (the logits the step needs)."""
        kept, offset = [], 0
        for group in self.groups:
            kept.append(offset + torch.arange(1, group.rows + 1) * group.width - 1)
            offset += group.tokens
        return torch.cat(kept)


@dataclass(frozen=True)
class StepPart:
    """One group's inputs to a packed forward: ``ids [rows, width]`` over ``cache``, with its cascade ``context``
    (read before the forward). The running rows of a pool are a part of width 1; an admission's chunk is one of
    width ``c``; parts of different pools each carry their own prefix in their context."""

    ids: torch.Tensor
    cache: SuffixCache
    context: CascadeContext


def pack_parts(parts: list[StepPart]) -> tuple[PackedCascade, torch.Tensor, torch.Tensor]:
    """One packed forward over ``parts``, in their order. Returns the packed cascade (the model's ``cascade``, its
    :attr:`~PackedCascade.cache` the model's cache) and the flat ``input_ids`` and ``position_ids``
    ``[1, sum of rows * width]``; left padding gets clamped positions."""
    groups = [PackedGroup(part.ids.shape[0], part.ids.shape[1], part.cache, part.context) for part in parts]
    ids = torch.cat([part.ids.reshape(-1) for part in parts])
    positions = torch.cat([p.context.query_positions(p.ids.shape[1]).clamp(min=0).reshape(-1) for p in parts])
    return PackedCascade(groups), ids.view(1, -1), positions.view(1, -1)


class _PackedLayer(CacheLayerMixin):
    """One layer of a packed forward's cache: writes each group's keys and values into that group's own
    suffix cache, and keeps what those return for the attention of this layer."""

    is_sliding = False

    def __init__(self, packed: PackedCascade, layer_idx: int) -> None:
        super().__init__()
        self._packed = packed
        self._layer_idx = layer_idx
        self.is_initialized = True
        self.attended: list[tuple[torch.Tensor, torch.Tensor]] = []  # per group: (keys, values) after the write

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the groups' own caches hold the tensors

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[1, KVH, B + A*c, D]`` into the groups' caches; the model's attention gets them unchanged
        (cascade attention reads each group's keys from :attr:`attended`)."""
        keys, values = self._packed.split(key_states), self._packed.split(value_states)
        self.attended = [
            group.cache.layers[self._layer_idx].update(k, v)
            for group, k, v in zip(self._packed.groups, keys, values, strict=True)
        ]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the model's own mask is not read by cascade attention: keep it small

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class _PackedCache(Cache):
    """The cache object a packed forward hands the model."""

    def __init__(self, packed: PackedCascade) -> None:
        num_layers = len(packed.groups[0].cache.layers)
        super().__init__(layers=[_PackedLayer(packed, i) for i in range(num_layers)])
