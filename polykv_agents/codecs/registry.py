"""Build codecs from configs, and decode any :class:`EncodedTensor` from its own metadata."""

from __future__ import annotations

from typing import Protocol

import torch

from polykv_agents.codecs.encoded import EncodedTensor
from polykv_agents.codecs.full_precision import FullPrecisionCodec
from polykv_agents.codecs.int_linear import IntLinearCodec
from polykv_agents.codecs.turboquant import TurboQuantCodec
from polykv_agents.config import CodecConfig


class TensorCodec(Protocol):
    """What every codec provides."""

    name: str

    def encode(self, x: torch.Tensor) -> EncodedTensor: ...

    def decode(self, enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor: ...


_CODECS = {codec.name: codec for codec in (IntLinearCodec, TurboQuantCodec, FullPrecisionCodec)}


def build_codec(config: CodecConfig, *, seed: int = 0) -> TensorCodec:
    """The codec described by ``config``; ``seed`` drives TurboQuant's random rotation."""
    if config.method == "int":
        return IntLinearCodec(bits=config.bits, granularity=config.granularity)
    if config.method == "turboquant":
        return TurboQuantCodec(bits=config.bits, seed=seed, rotation=config.rotation, random_signs=config.random_signs)
    return FullPrecisionCodec()


def decode(enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode ``enc`` with the codec named in its own metadata."""
    try:
        codec_cls = _CODECS[enc.codec]
    except KeyError as e:
        msg = f"unknown codec {enc.codec!r} in an encoded tensor; known codecs: {sorted(_CODECS)}"
        raise ValueError(msg) from e
    return codec_cls.from_params(dict(enc.params)).decode(enc, dtype)
