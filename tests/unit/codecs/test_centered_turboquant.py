"""Centered TurboQuant: sinks kept exactly, the channel mean removed, 8-bit norms, keys compressed before RoPE."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_causal_lm, tiny_gemma3

from polykv_agents import codecs
from polykv_agents.codecs.centered_turboquant import CenteredTurboQuantCodec
from polykv_agents.codecs.rotary import rotate_keys
from polykv_agents.codecs.turboquant import TurboQuantCodec
from polykv_agents.config import CodecConfig, CompressionConfig
from polykv_agents.model.rope import move_keys, rope_frequencies

INV_FREQ = 1.0 / (10_000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))  # [32]: a 64-channel head


def _relative_error(x: torch.Tensor, decoded: torch.Tensor) -> float:
    return float((x.float() - decoded.float()).norm() / x.float().norm())


def _offset_tensor(seed: int = 0, tokens: int = 96) -> torch.Tensor:
    """``[1, 2, tokens, 64]``: unit noise on a per-channel offset five times larger, and a huge first token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, tokens, 64, generator=g) + 5 * torch.randn(1, 2, 1, 64, generator=g)
    x[:, :, 0] *= 40  # an attention sink
    return x


def test_sink_tokens_are_stored_exactly_and_the_rest_is_approximate() -> None:
    x = _offset_tensor().to(torch.bfloat16)
    decoded = codecs.decode(CenteredTurboQuantCodec(3, sink_tokens=4).encode(x))
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    assert torch.equal(decoded[:, :, :4], x[:, :, :4])
    assert 0 < _relative_error(x[:, :, 4:], decoded[:, :, 4:]) < 0.1


def test_removing_the_channel_mean_and_the_sink_beats_plain_turboquant_at_the_same_bits() -> None:
    x = _offset_tensor()
    plain = _relative_error(x[:, :, 1:], TurboQuantCodec(3).decode(TurboQuantCodec(3).encode(x))[:, :, 1:])
    codec = CenteredTurboQuantCodec(3, sink_tokens=1, norm_bits=16)
    centered = _relative_error(x[:, :, 1:], codec.decode(codec.encode(x))[:, :, 1:])
    assert centered < plain / 3  # the offset is 5x the noise: plain quantises it with every vector


def test_eight_bit_norms_cost_little_next_to_the_directions_error() -> None:
    x = _offset_tensor()
    sixteen = CenteredTurboQuantCodec(3, norm_bits=16)
    eight = CenteredTurboQuantCodec(3, norm_bits=8)
    enc16, enc8 = sixteen.encode(x), eight.encode(x)
    assert enc8.tensors["norm_codes"].dtype == torch.uint8 and "norms" not in enc8.tensors
    assert enc8.nbytes < enc16.nbytes
    # same directions, so the only difference is the norms: each within half a log step of the fp16 one
    centered8 = eight.decode(enc8)[:, :, 4:] - enc8.tensors["mean"]
    centered16 = sixteen.decode(enc16)[:, :, 4:] - enc16.tensors["mean"]
    ratio = centered8.norm(dim=-1) / centered16.norm(dim=-1)
    half_step = 2 ** (enc8.tensors["norm_range"][..., 1].max() / 2)
    assert float(ratio.max()) <= float(half_step) * 1.001 and float(ratio.min()) >= 1 / float(half_step) / 1.001
    assert _relative_error(x, eight.decode(enc8)) < 1.05 * _relative_error(x, sixteen.decode(enc16))


def test_rotate_keys_undoes_itself_and_agrees_with_the_models_rope() -> None:
    model = tiny_causal_lm("llama")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    keys = torch.randn(1, 2, 5, head_dim)
    inv_freq = rope_frequencies(model, 0)
    assert torch.allclose(rotate_keys(rotate_keys(keys, inv_freq, first_position=3), inv_freq, first_position=3,
                                      inverse=True), keys, atol=1e-5)  # fmt: skip
    for position in (0, 1, 17):  # one token at ``position``: the model's own rotation by that many positions
        one = keys[:, :, :1]
        assert torch.allclose(rotate_keys(one, inv_freq, first_position=position), move_keys(model, one, position),
                              atol=1e-5)  # fmt: skip


def test_keys_with_an_offset_before_rope_are_compressed_better_before_rope() -> None:
    g = torch.Generator().manual_seed(1)
    unrotated = torch.randn(1, 2, 256, 64, generator=g) + 4 * torch.randn(1, 2, 1, 64, generator=g)
    keys = rotate_keys(unrotated, INV_FREQ)  # as cached: the offset spins with the position
    after = CenteredTurboQuantCodec(3, sink_tokens=0)
    before = CenteredTurboQuantCodec(3, sink_tokens=0, before_rope=True)
    encoded = before.encode(keys, rope_inv_freq=INV_FREQ)
    assert torch.equal(encoded.tensors["rope_inv_freq"], INV_FREQ)
    error_before = _relative_error(keys, codecs.decode(encoded))
    assert error_before < _relative_error(keys, after.decode(after.encode(keys))) / 2


def test_sinks_before_rope_keep_their_positions() -> None:
    keys = rotate_keys(_offset_tensor(tokens=40), INV_FREQ)
    codec = CenteredTurboQuantCodec(4, sink_tokens=3, before_rope=True)
    decoded = codec.decode(codec.encode(keys, rope_inv_freq=INV_FREQ))
    assert torch.equal(decoded[:, :, :3], keys[:, :, :3])
    assert _relative_error(keys[:, :, 3:], decoded[:, :, 3:]) < 0.1  # the rest re-rotated at positions 3..


def test_a_tensor_of_sinks_only_round_trips_exactly() -> None:
    x = _offset_tensor(tokens=3)
    codec = CenteredTurboQuantCodec(2, sink_tokens=4)
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_before_rope_without_frequencies_and_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="rope_inv_freq"):
        CenteredTurboQuantCodec(3, before_rope=True).encode(torch.randn(1, 1, 8, 64))
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        CenteredTurboQuantCodec(3).encode(torch.randn(8, 64))
    with pytest.raises(ValueError, match="non-finite"):
        CenteredTurboQuantCodec(3).encode(torch.full((1, 1, 8, 64), float("nan")))


def test_config_labels_validation_and_the_key_only_rule() -> None:
    keys = CodecConfig(method="centered_turboquant", bits=3, before_rope=True)
    assert keys.label() == "ctq3/pre-rope"
    config = CompressionConfig(keys=keys, values=CodecConfig(method="centered_turboquant", bits=2))
    assert config.label() == "K:ctq3/pre-rope V:ctq2"
    assert CompressionConfig.model_validate(config.model_dump()) == config
    with pytest.raises(ValueError, match="key codec only"):
        CompressionConfig(values=keys)
    with pytest.raises(ValueError, match="bits=5 is not supported"):
        CodecConfig(method="centered_turboquant", bits=5)
    with pytest.raises(ValueError, match="does not apply to method='centered_turboquant'"):
        CodecConfig(method="centered_turboquant", granularity="token")


def test_rope_frequencies_follow_gemma3s_layer_types_and_gpt2_is_refused() -> None:
    model = tiny_gemma3()
    rotary = model.model.rotary_emb
    types = model.config.layer_types
    for layer, layer_type in enumerate(types):
        assert torch.equal(rope_frequencies(model, layer), getattr(rotary, f"{layer_type}_inv_freq").float())
    assert not torch.equal(rope_frequencies(model, 0), rope_frequencies(model, types.index("full_attention")))
    assert rope_frequencies(tiny_causal_lm("gpt2"), 0).numel() == 0  # absolute positions: no channel rotated


def test_keys_without_rope_are_left_as_they_are_by_empty_frequencies() -> None:
    keys = _offset_tensor(tokens=20)
    assert torch.equal(rotate_keys(keys, torch.empty(0), first_position=7), keys)
    codec = CenteredTurboQuantCodec(4, before_rope=True)
    plain = CenteredTurboQuantCodec(4)
    assert torch.equal(codec.decode(codec.encode(keys, rope_inv_freq=torch.empty(0))), plain.decode(plain.encode(keys)))


def test_a_rope_whose_rotation_depends_on_the_length_is_refused() -> None:
    model = tiny_causal_lm("llama")
    model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(ValueError, match="before_rope=False"):
        rope_frequencies(model, 0)


def test_one_token_after_the_sinks_is_its_own_mean_and_round_trips_finite() -> None:
    x = _offset_tensor(tokens=5)  # 4 sinks, then one token: centered, it is zero
    for norm_bits in (8, 16):
        codec = CenteredTurboQuantCodec(3, sink_tokens=4, norm_bits=norm_bits)
        decoded = codec.decode(codec.encode(x))
        assert torch.isfinite(decoded).all()
        assert torch.allclose(decoded, x, atol=1e-5)
