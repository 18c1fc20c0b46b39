"""Linear integer key codec: quantiser correctness, scale layout, storage and granularity."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polykv_agents import codecs
from polykv_agents.codecs.bitpack import unpack_codes
from polykv_agents.codecs.encoded import EncodedTensor
from polykv_agents.codecs.int_linear import IntLinearCodec

GRANULARITIES = ["tensor", "channel", "token"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scale_shape(granularity: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    b, h, t, d = shape
    return {"tensor": (1, 1, 1, 1), "channel": (b, h, 1, d), "token": (b, h, t, 1)}[granularity]


def _integer_codes(codec: IntLinearCodec, enc: EncodedTensor) -> torch.Tensor:
    """The signed integers the codec chose, as int64 of the original shape."""
    codes = enc.tensors["codes"]
    if codec.bits == 8:
        return codes.long().reshape(enc.shape)
    return unpack_codes(codes, codec.bits, enc.numel).long().reshape(enc.shape) - codec.qmax


def _assert_within_half_a_step(x: torch.Tensor, enc: EncodedTensor, decoded: torch.Tensor) -> None:
    """|x - dec| <= scale / 2 for every element (float32 arithmetic adds a hair of slack)."""
    scale = enc.tensors["scale"].float().expand(enc.shape)
    err = (x.float() - decoded.float()).abs()
    bound = scale / 2 * (1 + 1e-5) + 1e-6 * x.float().abs()
    assert bool((err <= bound).all()), float((err / scale).max())


# --------------------------------------------------------------------------- quantiser correctness


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bits", [8, 4])
def test_roundtrip_error_is_at_most_half_a_step(bits: int, granularity: str) -> None:
    """Every element is reconstructed to within half its group's quantisation step.

    That is the defining property of round-to-nearest with absmax scales: nothing is clipped (the
    group maximum maps to ±qmax) and everything else rounds to the nearest multiple of the scale.
    Codes stay in [-qmax, qmax] (symmetric: -128 is never used at 8 bits).
    """
    shape = (2, 3, 17, 16)
    x = torch.randn(*shape, generator=_gen(bits)) * torch.linspace(0.1, 5.0, 16)
    codec = IntLinearCodec(bits, granularity)
    enc = codec.encode(x)
    decoded = codec.decode(enc)
    assert decoded.shape == x.shape
    assert decoded.dtype == x.dtype
    _assert_within_half_a_step(x, enc, decoded)
    q = _integer_codes(codec, enc)
    assert int(q.min()) >= -codec.qmax
    assert int(q.max()) <= codec.qmax
    # The group maximum uses the full range (the scale is absmax / qmax, rounded to fp16).
    assert int(q.abs().max()) == codec.qmax


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_scale_layout(granularity: str) -> None:
    """Scales are fp16, one per group: tensor [1,1,1,1], channel [b,h,1,d], token [b,h,t,1]."""
    shape = (2, 3, 5, 8)
    x = torch.randn(*shape, generator=_gen(1))
    enc = IntLinearCodec(8, granularity).encode(x)
    scale = enc.tensors["scale"]
    assert scale.dtype == torch.float16
    assert tuple(scale.shape) == _scale_shape(granularity, shape)
    # Each scale is its group's absmax / qmax (rounded to fp16).
    amax = x.abs().amax(dim={"tensor": (0, 1, 2, 3), "channel": (2,), "token": (3,)}[granularity], keepdim=True)
    assert torch.allclose(scale.float(), amax / 127, rtol=1e-3)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_eight_bit_codes_are_plain_int8(granularity: str) -> None:
    """8-bit codes are stored unpacked as int8: exactly one byte per element."""
    shape = (1, 2, 9, 16)
    enc = IntLinearCodec(8, granularity).encode(torch.randn(*shape, generator=_gen(2)))
    codes = enc.tensors["codes"]
    assert codes.dtype == torch.int8
    assert codes.nbytes == math.prod(shape)
    assert enc.nbytes == codes.nbytes + enc.tensors["scale"].nbytes
    assert enc.nbytes == sum(t.nbytes for t in enc.tensors.values())


@pytest.mark.parametrize("shape", [(1, 2, 9, 16), (1, 1, 3, 5)])
@pytest.mark.parametrize("bits", [2, 3, 4, 7])
def test_narrow_codes_are_bit_packed(bits: int, shape: tuple[int, ...]) -> None:
    """Narrower codes are packed: ceil(numel / 8) * bits bytes (e.g. half a byte per 4-bit code)."""
    enc = IntLinearCodec(bits, "channel").encode(torch.randn(*shape, generator=_gen(3)))
    codes = enc.tensors["codes"]
    assert codes.dtype == torch.uint8
    assert codes.dim() == 1
    assert codes.nbytes == math.ceil(math.prod(shape) / 8) * bits


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_roundtrip_and_override(granularity: str, dtype: torch.dtype) -> None:
    """Decode returns the input dtype by default; ``dtype=`` overrides it."""
    x = torch.randn(1, 2, 6, 16, generator=_gen(4)).to(dtype)
    codec = IntLinearCodec(8, granularity)
    enc = codec.encode(x)
    assert codec.decode(enc).dtype == dtype
    assert codec.decode(enc, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bits", [8, 3])
def test_record_is_self_describing(bits: int, granularity: str) -> None:
    """The registry decodes from the record's own metadata exactly like the codec that wrote it."""
    codec = IntLinearCodec(bits, granularity)
    enc = codec.encode(torch.randn(2, 2, 7, 16, generator=_gen(5)).to(torch.bfloat16))
    assert enc.codec == "int"
    assert dict(enc.params) == {"bits": bits, "granularity": granularity}
    assert torch.equal(codecs.decode(enc), codec.decode(enc))


# --------------------------------------------------------------------------- granularity


def test_channel_granularity_wins_on_outlier_channels() -> None:
    """Keys have a few channels with huge magnitudes; per-channel scales isolate them.

    With one scale for the whole tensor, the outlier channel (50x larger) sets the step for every
    channel, so the ordinary channels are quantised with a step ~50x too coarse (at 4 bits most of
    them round to 0). Channel scales give each channel its own step. Token scales do not help
    the ordinary channels (every token vector contains the outlier). The total error is lower with
    channel scales than with one tensor scale too.
    """
    x = torch.randn(1, 2, 64, 32, generator=_gen(6))
    x[..., 5] *= 50
    ordinary = torch.ones(32, dtype=torch.bool)
    ordinary[5] = False
    total, on_ordinary = {}, {}
    for granularity in GRANULARITIES:
        codec = IntLinearCodec(4, granularity)
        sq_err = (codec.decode(codec.encode(x)) - x).square()
        total[granularity] = float(sq_err.mean())
        on_ordinary[granularity] = float(sq_err[..., ordinary].mean())
    assert on_ordinary["channel"] * 50 < on_ordinary["tensor"]
    assert on_ordinary["channel"] * 50 < on_ordinary["token"]
    assert total["channel"] < total["tensor"]


def test_eight_bits_beat_four_bits() -> None:
    x = torch.randn(1, 2, 32, 16, generator=_gen(7))
    errors = [float((c.decode(c.encode(x)) - x).square().mean()) for c in (IntLinearCodec(8), IntLinearCodec(4))]
    assert errors[0] * 100 < errors[1]


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bits", [8, 4])
def test_all_zero_tensor_decodes_to_zeros(bits: int, granularity: str) -> None:
    """An all-zero group gets a finite scale (1) and zero codes: decode is exactly zero, no NaN."""
    x = torch.zeros(1, 2, 3, 8)
    codec = IntLinearCodec(bits, granularity)
    enc = codec.encode(x)
    assert torch.isfinite(enc.tensors["scale"].float()).all()
    assert torch.equal(codec.decode(enc), x)


def test_zero_group_next_to_nonzero_groups() -> None:
    """A zero channel does not disturb the others under channel granularity."""
    x = torch.randn(1, 1, 4, 8, generator=_gen(8))
    x[..., 3] = 0
    codec = IntLinearCodec(8, "channel")
    enc = codec.encode(x)
    decoded = codec.decode(enc)
    assert torch.equal(decoded[..., 3], torch.zeros(1, 1, 4))
    _assert_within_half_a_step(x, enc, decoded)


@pytest.mark.parametrize("shape", [(8,), (4, 8), (2, 4, 8), (1, 2, 3, 4, 8)])
def test_non_4d_input_is_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="batch, kv_heads, tokens, head_dim"):
        IntLinearCodec(8).encode(torch.zeros(shape))


def test_fp16_scale_overflow_is_refused() -> None:
    """Magnitudes whose scale overflows fp16 raise instead of silently storing inf."""
    x = torch.full((1, 1, 2, 4), 1e8)
    with pytest.raises(ValueError, match="overflow"):
        IntLinearCodec(8, "tensor").encode(x)


@pytest.mark.parametrize(("bits", "granularity"), [(1, "channel"), (9, "channel"), (8, "row")])
def test_invalid_settings_are_rejected(bits: int, granularity: str) -> None:
    with pytest.raises(ValueError):
        IntLinearCodec(bits, granularity)


@pytest.mark.parametrize(("amax", "max_relative_error"), [(1e-3, 0.01), (1e-5, 0.01), (1e-6, 0.05)])
def test_half_step_bound_holds_for_tiny_groups(amax: float, max_relative_error: float) -> None:
    """The half-step bound holds for any magnitude: fp16 scales are rounded up, never down or to 0.

    Below ~7.6e-6 (127 x fp16's smallest subnormal) the scale saturates at 2**-24, so fewer levels
    are used and the relative error grows, but nothing is clipped and nothing decodes to all zeros.
    """
    x = torch.linspace(-amax, amax, 64).reshape(1, 1, 1, 64)
    codec = IntLinearCodec(8, "tensor")
    enc = codec.encode(x)
    decoded = codec.decode(enc)
    _assert_within_half_a_step(x, enc, decoded)
    assert float((decoded - x).norm() / x.norm()) < max_relative_error
    assert decoded.abs().max() > 0


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_zero_tokens_round_trip(granularity: str) -> None:
    x = torch.zeros(1, 2, 0, 8)
    codec = IntLinearCodec(8, granularity)
    assert codec.decode(codec.encode(x)).shape == x.shape


# --------------------------------------------------------------------------- property test


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 24), st.integers(1, 48)),
    bits=st.integers(2, 8),
    granularity=st.sampled_from(GRANULARITIES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    magnitude=st.sampled_from([0.1, 1.0, 100.0]),
    data_seed=st.integers(0, 2**16),
    zero_token=st.booleans(),
)
def test_roundtrip_properties(
    shape: tuple[int, int, int, int],
    bits: int,
    granularity: str,
    dtype: torch.dtype,
    magnitude: float,
    data_seed: int,
    zero_token: bool,
) -> None:
    """Any shape, 2–8 bits, any granularity and float dtype: shape/dtype round-trip, storage size,
    scale layout and the half-step error bound.

    Nonzero elements are kept at least 0.1 * magnitude (>= 0.01) away from zero so that no group's
    scale falls into fp16's subnormal range, where the bound is known to break (see the xfail
    ``test_half_step_bound_holds_for_tiny_groups``).
    """
    z = torch.randn(*shape, generator=_gen(data_seed))
    x = magnitude * torch.sign(z) * (z.abs() + 0.1)
    if zero_token:
        x[:, :, 0] = 0
    x = x.to(dtype)
    codec = IntLinearCodec(bits, granularity)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.shape == x.shape
    assert out.dtype == dtype
    assert tuple(enc.tensors["scale"].shape) == _scale_shape(granularity, shape)
    numel = math.prod(shape)
    expected_code_bytes = numel if bits == 8 else math.ceil(numel / 8) * bits
    assert enc.tensors["codes"].nbytes == expected_code_bytes
    q = _integer_codes(codec, enc)
    assert int(q.abs().max()) <= codec.qmax
    _assert_within_half_a_step(x, enc, codec.decode(enc, dtype=torch.float32))


# --------------------------------------------------------------------------- exact values and metadata


def test_default_is_eight_bits_per_channel() -> None:
    codec = IntLinearCodec()
    assert (codec.bits, codec.granularity, codec.qmax) == (8, "channel", 127)


@pytest.mark.parametrize(("bits", "qmax"), [(2, 1), (3, 3), (4, 7), (7, 63), (8, 127)])
def test_qmax_is_the_largest_symmetric_integer(bits: int, qmax: int) -> None:
    assert IntLinearCodec(bits).qmax == qmax


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bits", [3, 8])
def test_from_params_restores_every_setting(bits: int, granularity: str) -> None:
    codec = IntLinearCodec.from_params({"bits": bits, "granularity": granularity})
    assert (codec.bits, codec.granularity) == (bits, granularity)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_integers_at_full_scale_round_trip_exactly(bits: int) -> None:
    """amax == qmax gives the exactly representable scale 1: no needless round-up, exact decode."""
    qmax = 2 ** (bits - 1) - 1
    x = torch.arange(-qmax, qmax + 1, dtype=torch.float32).reshape(1, 1, 1, -1)
    codec = IntLinearCodec(bits, "tensor")
    enc = codec.encode(x)
    assert enc.tensors["scale"].dtype == torch.float16
    assert enc.tensors["scale"].item() == 1.0
    assert torch.equal(_integer_codes(codec, enc), x.long())
    assert torch.equal(codec.decode(enc), x)


def test_scale_of_a_unit_group_is_rounded_up_from_one_over_qmax() -> None:
    """amax 1: the fp16 scale is 1/127 rounded up (not the all-zero group's placeholder 1)."""
    x = torch.tensor([-1.0, -0.5, 0.25, 1.0]).reshape(1, 1, 1, 4)
    enc = IntLinearCodec(8, "tensor").encode(x)
    scale = enc.tensors["scale"].float().item()
    assert scale * 127 >= 1.0
    assert scale == pytest.approx(1 / 127, rel=1e-3)
    assert _integer_codes(IntLinearCodec(8, "tensor"), enc).flatten().tolist() == [-127, -63, 32, 127]


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_all_zero_group_gets_scale_one(granularity: str) -> None:
    enc = IntLinearCodec(4, granularity).encode(torch.zeros(1, 2, 3, 8))
    assert torch.equal(enc.tensors["scale"], torch.ones_like(enc.tensors["scale"]))
    assert enc.tensors["scale"].dtype == torch.float16


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bits", [4, 8])
def test_zero_tokens_keep_the_scale_layout(bits: int, granularity: str) -> None:
    shape = (2, 3, 0, 8)
    codec = IntLinearCodec(bits, granularity)
    enc = codec.encode(torch.zeros(shape))
    assert tuple(enc.tensors["scale"].shape) == _scale_shape(granularity, shape)
    assert enc.tensors["scale"].dtype == torch.float16
    out = codec.decode(enc)
    assert out.shape == shape
    assert out.dtype == torch.float32


def test_overflow_message_names_the_cause() -> None:
    x = torch.full((1, 1, 2, 4), 1e8)
    with pytest.raises(ValueError, match=r"^key/value magnitudes overflow an fp16 scale; the model produced"):
        IntLinearCodec(8, "tensor").encode(x)


def test_narrow_codes_are_offset_by_qmax() -> None:
    """3-bit codes are stored as q + 3 in 0..6, packed LSB first."""
    x = torch.tensor([-3.0, 0.0, 3.0, 1.0]).reshape(1, 1, 1, 4)
    codec = IntLinearCodec(3, "tensor")
    enc = codec.encode(x)
    assert unpack_codes(enc.tensors["codes"], 3, 4).tolist() == [0, 3, 6, 4]
    assert torch.equal(codec.decode(enc), x)
