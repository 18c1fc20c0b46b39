"""TurboQuant-MSE (Zandieh et al. 2025): the paper's value codec.

encode, per head vector ``x [head_dim]`` of ``[batch, kv_heads, tokens, head_dim]``:
  norm = ||x|| (kept in fp16) -> u = x / norm -> y = u @ R * sqrt(head_dim), R a randomized
  Hadamard rotation (seeded signs, then a normalised Hadamard), so the coordinates of y are close
  to N(0, 1) -> each coordinate -> index of its nearest Lloyd–Max centroid of N(0, 1) -> bit-packed.
decode: centroid lookup -> / sqrt(head_dim) -> @ R.T -> times the norm.

Only the seed is stored; the rotation is rebuilt (and cached) from it.
"""

from __future__ import annotations

import math

import torch

from polykv_agents.codecs.bitpack import pack_codes, unpack_codes
from polykv_agents.codecs.encoded import EncodedTensor, dtype_name
from polykv_agents.codecs.hadamard import random_rotation
from polykv_agents.codecs.lloyd_max import codes_to_values, gaussian_lloyd_max, quantize_to_codes
from polykv_agents.config import TurboQuantCodecConfig


def fp16_norms(norms: torch.Tensor) -> torch.Tensor:
    """Vector norms ``[..., 1]`` as stored: fp16 ``[...]``, refused if any is non-finite or past fp16's range."""
    norms16 = norms.squeeze(-1).to(torch.float16)
    if not torch.isfinite(norms16).all():
        msg = (
            "a head vector's norm is non-finite or exceeds the fp16 range (65504); "
            "the model produced non-finite or huge activations"
        )
        raise ValueError(msg)
    return norms16


class TurboQuantCodec:
    """Normalise, rotate, Lloyd–Max quantise at ``bits`` bits per coordinate."""

    name = "turboquant"

    def __init__(self, bits: int = 3, *, seed: int = 0, rotation: bool = True, random_signs: bool = True) -> None:
        TurboQuantCodecConfig(bits=bits, rotation=rotation, random_signs=random_signs)  # validates
        self.bits = bits
        self.seed = seed
        self.rotation = rotation
        self.random_signs = random_signs
        self.centroids, self.boundaries = gaussian_lloyd_max(bits)

    @classmethod
    def from_params(cls, params: dict) -> TurboQuantCodec:
        return cls(
            bits=params["bits"],
            seed=params["seed"],
            rotation=params["rotation"],
            random_signs=params["random_signs"],
        )

    def _rotation(self, head_dim: int, device: torch.device) -> torch.Tensor | None:
        if not self.rotation:
            return None
        return random_rotation(head_dim, self.seed, random_signs=self.random_signs, device=device)  # [d, d]

    def encode(self, x: torch.Tensor) -> EncodedTensor:
        if x.dim() != 4:
            msg = f"expected a [batch, kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}"
            raise ValueError(msg)
        x32 = x.float()
        norms = x32.norm(dim=-1, keepdim=True)  # [b, h, t, 1]
        norms16 = fp16_norms(norms)  # [b, h, t]: what decode will use
        unit = x32 / norms.clamp_min(torch.finfo(torch.float32).tiny)
        return EncodedTensor(
            codec=self.name,
            shape=tuple(x.shape),
            dtype=dtype_name(x.dtype),
            params={
                "bits": self.bits,
                "seed": self.seed,
                "rotation": self.rotation,
                "random_signs": self.random_signs,
            },
            tensors={"codes": self.quantize_directions(unit), "norms": norms16},
        )

    def decode(self, enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        unit = self.dequantize_directions(enc.tensors["codes"], enc.shape)
        out = unit * enc.tensors["norms"].float().unsqueeze(-1)
        return out.to(dtype or enc.torch_dtype)

    def quantize_directions(self, unit: torch.Tensor) -> torch.Tensor:
        """Bit-packed codes of unit vectors ``unit [..., head_dim]`` (float32): rotated, scaled to N(0, 1)
        coordinates, each coordinate's nearest Lloyd–Max centroid."""
        head_dim = unit.shape[-1]
        rotation = self._rotation(head_dim, unit.device)
        rotated = unit if rotation is None else unit @ rotation  # [..., d]
        codes = quantize_to_codes(rotated * math.sqrt(head_dim), self.boundaries.to(unit.device))
        return pack_codes(codes, self.bits)

    def dequantize_directions(self, packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 unit vectors ``[*shape]`` that :meth:`quantize_directions` packed (approximately)."""
        head_dim = shape[-1]
        codes = unpack_codes(packed, self.bits, int(torch.Size(shape).numel())).view(shape)
        rotated = codes_to_values(codes, self.centroids.to(packed.device)) / math.sqrt(head_dim)  # [..., d]
        rotation = self._rotation(head_dim, packed.device)
        return rotated if rotation is None else rotated @ rotation.T
