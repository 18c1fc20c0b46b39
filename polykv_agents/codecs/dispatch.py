"""Decode any :class:`EncodedTensor` from its own metadata.

The codecs themselves are registered once, in :data:`polykv_agents.config.AnyCodecConfig`: a config
class names its codec (``codec_class``) and builds it (``build``); decoding looks the codec up by
the name its record carries, which is the config's ``method``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from polykv_agents.codecs.encoded import EncodedTensor
from polykv_agents.config import CODEC_METHODS, codec_config_class


class TensorCodec(Protocol):
    """What every codec provides."""

    name: str

    def encode(self, x: torch.Tensor) -> EncodedTensor: ...

    def decode(self, enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor: ...


def decode(enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode ``enc`` with the codec named in its own metadata."""
    if enc.codec not in CODEC_METHODS:
        msg = f"unknown codec {enc.codec!r} in an encoded tensor; known codecs: {sorted(CODEC_METHODS)}"
        raise ValueError(msg)
    codec_cls = codec_config_class(enc.codec).codec_class()
    return codec_cls.from_params(dict(enc.params)).decode(enc, dtype)
