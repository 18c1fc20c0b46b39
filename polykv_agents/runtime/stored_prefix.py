"""A pool's layer as the native kernel reads it, with no decoded copy of the document.

The kernel (:mod:`polykv_agents.kernels`, ``grouped_attention.cpp``) attends over the pool's own bytes:

- keys: the int8 codes ``[KVH, T, D]`` of the int codec at 8 bits, one scale per (kv head, channel) or one per
  tensor; the scale goes into the queries once, so a score is a dot product with the codes widened to float;
- values: TurboQuant's bit-packed codes with their fp16 norms. A value is ``norm * centroids[code] / sqrt(D) @
  R.T``; the softmax-weighted sum over the keys runs on ``norm * centroids[code]`` and the rotation ``R.T``, being
  linear, is applied once to each query's sum, not to each stored row.

Every tensor of a :class:`StoredLayer` is a view of the pool's tensors except the key scale as float32
``[KVH, D]``, the codebook and the rotation: a few KiB per layer, whatever the document's length
(:meth:`StoredLayer.extra_tensors`). Other codecs (narrower keys, keys compressed before RoPE, centered values)
have no stored form: their prefix is decoded layer by layer (:class:`~polykv_agents.runtime.shared_prefix.
SharedPrefix`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from polykv_agents.codecs.hadamard import random_rotation
from polykv_agents.codecs.lloyd_max import gaussian_lloyd_max
from polykv_agents.pool.shared_pool import EncodedLayer, SharedKVPool

KEY_GRANULARITIES = ("channel", "tensor")
"""Key scales the kernel folds into the queries: one per (kv head, channel), or one for the whole tensor."""


@dataclass(frozen=True)
class StoredLayer:
    """One layer of a pool in the kernel's terms; shapes with ``KVH`` kv heads, ``T`` tokens, head dim ``D``."""

    key_codes: torch.Tensor
    """``[KVH, T, D]`` int8: a view of the pool's key codes."""
    key_scale: torch.Tensor
    """``[KVH, D]`` float32: each key channel's scale (a per-tensor scale repeated)."""
    value_codes: torch.Tensor
    """``[ceil(KVH*T*D / 8) * bits]`` uint8: the pool's bit stream of value codes, in ``[KVH, T, D]`` order."""
    value_norms: torch.Tensor
    """``[KVH, T]`` float16: a view of the pool's value norms."""
    centroids: torch.Tensor
    """``[2**bits]`` float32: the Lloyd–Max codebook divided by ``sqrt(D)``."""
    rotation: torch.Tensor
    """``[D, D]`` float32: ``R.T``, which takes a sum in the rotated domain back to the model's; empty where the
    codes were not rotated."""

    @property
    def num_tokens(self) -> int:
        return self.key_codes.shape[1]

    def extra_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors held beyond the pool's own: the key scale as float32, and the codebook and rotation, which
        layers of one codec share (one tensor each)."""
        return self.key_scale, self.centroids, self.rotation

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The kernel's argument for this group's prefix, in its order."""
        return [self.key_codes, self.key_scale, self.value_codes, self.value_norms, self.centroids, self.rotation]


def has_stored_form(layer: EncodedLayer) -> bool:
    """Whether the kernel reads ``layer`` as stored: int8 keys with a per-channel or per-tensor scale and
    TurboQuant values, one sequence."""
    keys, values = layer.keys, layer.values
    int8_keys = keys.codec == "int" and keys.params["bits"] == 8 and keys.params["granularity"] in KEY_GRANULARITIES
    return (
        int8_keys and values.codec == "turboquant" and keys.shape[0] == 1 and tuple(keys.shape) == tuple(values.shape)
    )


def stored_layer(layer: EncodedLayer) -> StoredLayer | None:
    """``layer`` in the kernel's terms, or ``None`` where its codecs have no stored form (see the module)."""
    if not has_stored_form(layer):
        return None
    keys, values = layer.keys, layer.values
    _, kv_heads, tokens, dim = keys.shape
    key_scale = keys.tensors["scale"].float().reshape(-1, 1, dim if keys.params["granularity"] == "channel" else 1)
    return StoredLayer(
        key_codes=keys.tensors["codes"].view(kv_heads, tokens, dim),
        key_scale=key_scale.expand(kv_heads, 1, dim).reshape(kv_heads, dim).contiguous(),
        value_codes=values.tensors["codes"],
        value_norms=values.tensors["norms"].view(kv_heads, tokens),
        centroids=_codebook(values.params["bits"], dim),
        rotation=_inverse_rotation(
            dim, values.params["seed"], values.params["random_signs"], values.params["rotation"]
        ),
    )


@functools.lru_cache(maxsize=16)
def _codebook(bits: int, dim: int) -> torch.Tensor:
    """``[2**bits]`` float32: the Lloyd–Max centroids of N(0, 1) divided by ``sqrt(dim)``, as TurboQuant decodes."""
    centroids, _ = gaussian_lloyd_max(bits)
    return (centroids / math.sqrt(dim)).contiguous()


@functools.lru_cache(maxsize=16)
def _inverse_rotation(dim: int, seed: int, random_signs: bool, rotated: bool) -> torch.Tensor:
    """``[dim, dim]`` float32 ``R.T``, which TurboQuant decodes with; empty where the codes were not rotated."""
    if not rotated:
        return torch.empty(0)
    return random_rotation(dim, seed, random_signs=random_signs).T.contiguous()


def stored_layers(pool: SharedKVPool) -> tuple[StoredLayer, ...] | None:
    """Every layer of ``pool`` in the kernel's terms, or ``None`` if any layer's codecs have no stored form."""
    if not all(has_stored_form(layer) for layer in pool.layers):
        return None
    return tuple(stored_layer(layer) for layer in pool.layers)  # type: ignore[misc]
