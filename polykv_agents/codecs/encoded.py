"""The record every codec returns: packed tensors plus the metadata needed to decode them.

Keeping the record self-describing means persistence is "tensors + a JSON header" and decoding
needs nothing but the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch


@dataclass(frozen=True)
class EncodedTensor:
    """One compressed tensor.

    Attributes:
        codec: Name of the codec that wrote it (``int``, ``turboquant`` or ``none``).
        shape: Shape of the original tensor, ``[batch, kv_heads, tokens, head_dim]``.
        dtype: Name of the original dtype (``float32``, ``bfloat16``, ...): what decode returns.
        params: JSON-able codec parameters (bits, granularity, seed, ...); a read-only mapping.
        tensors: The stored tensors (codes, scales, norms); a read-only mapping, so no tensor of a
            pool can be swapped for another while the pool's digest stays.
    """

    codec: str
    shape: tuple[int, ...]
    dtype: str
    params: Mapping[str, Any]
    tensors: Mapping[str, torch.Tensor]

    def __post_init__(self) -> None:
        # Private read-only copies: neither the caller's dicts nor this record can be changed later.
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A mappingproxy cannot be pickled (Ray ships records between processes): rebuild from dicts.
        return type(self), (self.codec, self.shape, self.dtype, dict(self.params), dict(self.tensors))

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: the sum of ``nbytes`` over every stored tensor."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return int(torch.Size(self.shape).numel())

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")
