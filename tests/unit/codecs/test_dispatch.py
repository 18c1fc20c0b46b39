"""Decoding a record with the codec it names, rebuilt from the record's own parameters."""

from __future__ import annotations

import torch

from polykv_agents.codecs import decode
from polykv_agents.config import TurboQuantCodecConfig


def test_decode_rebuilds_the_codec_from_the_record() -> None:
    codec = TurboQuantCodecConfig(bits=3).build(7)
    x = torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(0))  # [batch, kv_heads, tokens, head_dim]
    enc = codec.encode(x)
    assert enc.params["seed"] == 7
    assert torch.equal(decode(enc), codec.decode(enc))
    # The seed travels in the record: a codec with another seed decodes the same codes differently.
    assert not torch.equal(decode(enc), TurboQuantCodecConfig(bits=3).build(0).decode(enc))
