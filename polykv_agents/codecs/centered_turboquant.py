"""Centered TurboQuant: TurboQuant-MSE of what remains once a KV tensor's outliers are taken out.

encode, for ``x [batch, kv_heads, tokens, head_dim]``:
  the first ``sink_tokens`` tokens -> stored as they are (attention sinks: vectors unlike all others)
  the rest -> (keys with ``before_rope``: the rotary rotation of each position removed, from the
  layer's ``rope_inv_freq``) -> mean over tokens per (head, channel), stored in float32 and
  subtracted -> norm of each vector, stored in ``norm_bits`` bits -> the unit direction through
  TurboQuant's rotation and Lloyd–Max codebook, bit-packed.
decode: the same steps backwards; the rotary rotation (when removed) is applied again from the
stored frequencies, so decoding needs nothing but the record.

8-bit norms are log-spaced between each head's smallest and largest norm (stored in float32): a
relative step of ``(max / min) ** (1 / 255)``, well below the direction's own quantisation error.
"""

from __future__ import annotations

import torch

from polykv_agents.codecs.encoded import EncodedTensor, dtype_name
from polykv_agents.codecs.rotary import rotate_keys
from polykv_agents.codecs.turboquant import TurboQuantCodec, fp16_norms
from polykv_agents.config import CenteredTurboQuantCodecConfig

_NORM_LEVELS = 255  # 8-bit norm codes 0..255
_SMALLEST_NORM_FRACTION = 2.0**-24  # norms below max * this are stored as that (keeps the log range finite)


class CenteredTurboQuantCodec:
    """Sink tokens as they are, channel mean removed, the remainder TurboQuant-MSE at ``bits`` bits."""

    name = "centered_turboquant"

    def __init__(
        self, bits: int = 3, *, seed: int = 0, sink_tokens: int = 4, norm_bits: int = 8, before_rope: bool = False
    ) -> None:
        CenteredTurboQuantCodecConfig(
            bits=bits, sink_tokens=sink_tokens, norm_bits=norm_bits, before_rope=before_rope
        )  # validates
        self.bits = bits
        self.seed = seed
        self.sink_tokens = sink_tokens
        self.norm_bits = norm_bits
        self.before_rope = before_rope
        self._directions = TurboQuantCodec(bits, seed=seed)

    @classmethod
    def from_params(cls, params: dict) -> CenteredTurboQuantCodec:
        return cls(
            bits=params["bits"],
            seed=params["seed"],
            sink_tokens=params["sink_tokens"],
            norm_bits=params["norm_bits"],
            before_rope=params["before_rope"],
        )

    def encode(self, x: torch.Tensor, *, rope_inv_freq: torch.Tensor | None = None) -> EncodedTensor:
        """``rope_inv_freq [rotary_dim / 2]``: the layer's rotary frequencies, required with ``before_rope``."""
        if x.dim() != 4:
            msg = f"expected a [batch, kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}"
            raise ValueError(msg)
        if self.before_rope and rope_inv_freq is None:
            msg = "before_rope=True needs the layer's rotary frequencies: pass rope_inv_freq (the pool does)"
            raise ValueError(msg)
        sinks = min(self.sink_tokens, x.shape[-2])
        rest = x[:, :, sinks:].float()  # [b, h, t - sinks, d]
        tensors: dict[str, torch.Tensor] = {"sink": x[:, :, :sinks].detach().clone().contiguous()}
        if self.before_rope:
            rope_inv_freq = rope_inv_freq.detach().float().cpu().contiguous()
            rest = rotate_keys(rest, rope_inv_freq, first_position=sinks, inverse=True)
            tensors["rope_inv_freq"] = rope_inv_freq
        mean = rest.mean(dim=-2, keepdim=True) if rest.shape[-2] else rest.new_zeros(*rest.shape[:2], 1, rest.shape[-1])
        centered = rest - mean
        norms = centered.norm(dim=-1, keepdim=True)  # [b, h, t', 1]
        unit = centered / norms.clamp_min(torch.finfo(torch.float32).tiny)
        tensors |= {"mean": mean, "codes": self._directions.quantize_directions(unit), **self._encode_norms(norms)}
        return EncodedTensor(
            codec=self.name,
            shape=tuple(x.shape),
            dtype=dtype_name(x.dtype),
            params={
                "bits": self.bits,
                "seed": self.seed,
                "sink_tokens": self.sink_tokens,
                "norm_bits": self.norm_bits,
                "before_rope": self.before_rope,
            },
            tensors=tensors,
        )

    def decode(self, enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        sink = enc.tensors["sink"]
        batch, heads, tokens, head_dim = enc.shape
        rest_shape = (batch, heads, tokens - sink.shape[-2], head_dim)
        unit = self._directions.dequantize_directions(enc.tensors["codes"], rest_shape)
        rest = unit * self._decode_norms(enc.tensors) + enc.tensors["mean"]
        if self.before_rope:
            rest = rotate_keys(rest, enc.tensors["rope_inv_freq"], first_position=sink.shape[-2])
        out_dtype = dtype or enc.torch_dtype
        return torch.cat([sink.to(out_dtype), rest.to(out_dtype)], dim=-2)

    def _encode_norms(self, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        """``norms [b, h, t', 1]`` as stored tensors: fp16, or 8-bit log codes with each head's log2 range."""
        if self.norm_bits == 16:
            return {"norms": fp16_norms(norms)}
        if not torch.isfinite(norms).all():
            msg = "a head vector's norm is non-finite: the model produced non-finite activations"
            raise ValueError(msg)
        if norms.shape[-2] == 0:  # every token is a sink
            return {"norm_codes": norms.squeeze(-1).to(torch.uint8), "norm_range": norms.new_zeros(*norms.shape[:2], 2)}
        # The floor keeps log2 finite when a head's vectors all equal their mean (norm 0): tiny * 2**-24 underflows.
        tiny = torch.finfo(torch.float32).tiny
        floor = (norms.amax(dim=-2, keepdim=True) * _SMALLEST_NORM_FRACTION).clamp_min(tiny)  # [b, h, 1, 1]
        log_norms = norms.clamp_min(floor).log2()
        low, high = log_norms.amin(dim=-2, keepdim=True), log_norms.amax(dim=-2, keepdim=True)
        step = (high - low).clamp_min(torch.finfo(torch.float32).eps) / _NORM_LEVELS
        codes = ((log_norms - low) / step).round().clamp(0, _NORM_LEVELS).to(torch.uint8)
        return {"norm_codes": codes.squeeze(-1), "norm_range": torch.cat([low, step], dim=-1).squeeze(-2)}

    @staticmethod
    def _decode_norms(tensors) -> torch.Tensor:
        """The norms ``[b, h, t', 1]`` (float32) stored by :meth:`_encode_norms`."""
        if "norms" in tensors:
            return tensors["norms"].float().unsqueeze(-1)
        low, step = tensors["norm_range"].unsqueeze(-2).unbind(-1)  # [b, h, 1] each
        return torch.exp2(low + tensors["norm_codes"].float() * step).unsqueeze(-1)
