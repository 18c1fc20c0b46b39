"""Linear integer quantisation with shared scales (the paper's key codec).

encode: ``x [batch, kv_heads, tokens, head_dim]`` -> per-group absmax scale (fp16) -> signed
integers in ``[-qmax, qmax]``. 8-bit codes are stored as ``int8`` as they are; narrower codes are
shifted to ``[0, 2*qmax]`` and bit-packed. decode: integers times their scale.
"""

from __future__ import annotations

import torch

from polykv_agents.codecs.bitpack import pack_codes, unpack_codes
from polykv_agents.codecs.encoded import EncodedTensor, dtype_name
from polykv_agents.config import IntCodecConfig

# Dimensions of [batch, kv_heads, tokens, head_dim] that share one scale, per granularity.
_REDUCED_DIMS: dict[str, tuple[int, ...]] = {
    "tensor": (0, 1, 2, 3),  # scale [1, 1, 1, 1]
    "channel": (2,),  # scale [batch, kv_heads, 1, head_dim]: one per channel over all tokens
    "token": (3,),  # scale [batch, kv_heads, tokens, 1]: one per token-head vector
}


class IntLinearCodec:
    """Symmetric linear quantisation to ``bits`` bits with fp16 scales."""

    name = "int"

    def __init__(self, bits: int = 8, granularity: str = "channel") -> None:
        IntCodecConfig(bits=bits, granularity=granularity)  # validates
        self.bits = bits
        self.granularity = granularity
        self.qmax = 2 ** (bits - 1) - 1

    @classmethod
    def from_params(cls, params: dict) -> IntLinearCodec:
        return cls(bits=params["bits"], granularity=params["granularity"])

    def encode(self, x: torch.Tensor) -> EncodedTensor:
        if x.dim() != 4:
            msg = f"expected a [batch, kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}"
            raise ValueError(msg)
        x32 = x.float()
        reduced = _REDUCED_DIMS[self.granularity]
        if x32.numel():
            amax = x32.abs().amax(dim=reduced, keepdim=True)
        else:  # zero tokens: amax over an empty axis is undefined
            amax = torch.zeros([1 if d in reduced else n for d, n in enumerate(x.shape)], device=x.device)
        # The scale is fp16 and fixed *before* quantising, so decode uses exactly the scale that chose
        # the integers. Rounding it up (never down, never to zero for a non-zero group) keeps every
        # element within [-qmax, qmax] steps, so the error stays at most half a step.
        scale = (amax / self.qmax).to(torch.float16)
        too_small = scale.float() * self.qmax < amax
        scale = torch.where(too_small, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)  # an all-zero group decodes to 0 anyway
        if not torch.isfinite(scale).all():
            msg = "key/value magnitudes overflow an fp16 scale; the model produced non-finite or huge activations"
            raise ValueError(msg)
        q = torch.round(x32 / scale.float()).clamp_(-self.qmax, self.qmax)
        codes = q.to(torch.int8) if self.bits == 8 else pack_codes((q + self.qmax).to(torch.uint8), self.bits)
        return EncodedTensor(
            codec=self.name,
            shape=tuple(x.shape),
            dtype=dtype_name(x.dtype),
            params={"bits": self.bits, "granularity": self.granularity},
            tensors={"codes": codes, "scale": scale},
        )

    def decode(self, enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        codes = enc.tensors["codes"]
        if self.bits == 8:
            q = codes.float()
        else:
            q = unpack_codes(codes, self.bits, enc.numel).float().sub_(self.qmax).view(enc.shape)
        return (q * enc.tensors["scale"].float()).to(dtype or enc.torch_dtype)
