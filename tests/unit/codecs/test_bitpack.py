"""Bit packing: exact round trips, exact lengths, a pinned bit order, and input validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polykv_agents.codecs.bitpack import pack_codes, packed_length, unpack_codes


def _reference_pack(codes: list[int], bits: int) -> bytes:
    """Pure-Python packer: one little-endian integer with code i at bit offset i * bits."""
    value = 0
    for i, code in enumerate(codes):
        value |= code << (i * bits)
    return value.to_bytes(math.ceil(len(codes) / 8) * bits, "little")


def _random_codes(shape: tuple[int, ...], bits: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, shape, generator=gen, dtype=torch.int64).to(torch.uint8)


@settings(max_examples=300, deadline=None)
@given(
    bits=st.integers(1, 8),
    shape=st.lists(st.integers(0, 13), min_size=0, max_size=4).map(tuple),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact_and_length_is_exact(bits: int, shape: tuple[int, ...], seed: int) -> None:
    codes = _random_codes(shape, bits, seed)
    packed = pack_codes(codes, bits)
    n = codes.numel()
    assert packed.dtype == torch.uint8
    assert packed.shape == (math.ceil(n / 8) * bits,)
    assert packed.numel() == packed_length(n, bits)
    out = unpack_codes(packed, bits, n)
    assert out.dtype == torch.uint8
    assert torch.equal(out, codes.reshape(-1))
    assert torch.equal(out.reshape(shape), codes)


@settings(max_examples=100, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 40), seed=st.integers(0, 2**31 - 1))
def test_matches_reference_bit_order(bits: int, n: int, seed: int) -> None:
    codes = _random_codes((n,), bits, seed)
    assert bytes(pack_codes(codes, bits).tolist()) == _reference_pack(codes.tolist(), bits)


def test_known_three_bit_pattern() -> None:
    # Codes 0..7 at 3 bits: the 24-bit little-endian stream is sum(i << 3i) = 0xFAC688, i.e.
    # byte 0 = 0b10001000 (code 1 at bits 3-5, low bits of code 2 at 6-7), and so on.
    packed = pack_codes(torch.arange(8, dtype=torch.uint8), 3)
    assert packed.tolist() == [0b10001000, 0b11000110, 0b11111010]


def test_known_one_bit_pattern_and_padding() -> None:
    # 10 one-bit codes: 8 fill byte 0 LSB first; the last 2 plus 6 zero pad codes fill byte 1.
    codes = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.uint8)
    packed = pack_codes(codes, 1)
    assert packed.tolist() == [0b10000001, 0b00000011]
    assert torch.equal(unpack_codes(packed, 1, 10), codes)


def test_eight_bits_is_a_padded_copy() -> None:
    codes = torch.arange(250, 255, dtype=torch.uint8)
    packed = pack_codes(codes, 8)
    assert packed.tolist() == [250, 251, 252, 253, 254, 0, 0, 0]
    packed[0] = 0
    assert codes[0] == 250  # the result never aliases the input


def test_three_bit_density() -> None:
    # 1000 codes at 3 bits: 3000 bits = 375 bytes exactly (1000 is a multiple of 8).
    codes = _random_codes((10, 100), 3, 0)
    assert pack_codes(codes, 3).numel() == 375
    assert pack_codes(codes.reshape(-1)[:999], 3).numel() == 375  # < 8 codes of padding


def test_non_contiguous_input() -> None:
    codes = _random_codes((6, 10), 5, 1).T
    assert not codes.is_contiguous()
    assert torch.equal(unpack_codes(pack_codes(codes, 5), 5, 60), codes.reshape(-1))


@pytest.mark.parametrize("bits", [0, 9, -1])
def test_bits_out_of_range(bits: int) -> None:
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack_codes(torch.zeros(4, dtype=torch.uint8), bits, 4)


def test_wrong_dtype() -> None:
    with pytest.raises(TypeError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="uint8"):
        unpack_codes(torch.zeros(2, dtype=torch.int8), 2, 8)


def test_code_too_large() -> None:
    with pytest.raises(ValueError, match="2\\*\\*bits"):
        pack_codes(torch.tensor([0, 4], dtype=torch.uint8), 2)


def test_wrong_packed_length() -> None:
    packed = pack_codes(torch.zeros(9, dtype=torch.uint8), 3)  # 6 bytes
    with pytest.raises(ValueError, match="6 bytes"):
        unpack_codes(packed[:5], 3, 9)
    with pytest.raises(ValueError, match="9 bytes"):
        unpack_codes(packed, 3, 17)
    with pytest.raises(ValueError, match="1-D"):
        unpack_codes(packed.reshape(2, 3), 3, 9)
    with pytest.raises(ValueError, match="count"):
        unpack_codes(packed, 3, -1)


@pytest.mark.parametrize("bits", [True, 2.5, "3"])
def test_bits_must_be_a_plain_int(bits: object) -> None:
    """bool is an int subclass and 2.5 lies in 1..8: both must still be refused."""
    with pytest.raises(ValueError, match=r"^bits must be an int in 1\.\.8, got "):
        packed_length(8, bits)  # type: ignore[arg-type]


def test_too_wide_codes_name_the_limit_and_the_largest_code() -> None:
    with pytest.raises(ValueError, match=r"^codes must all be < 2\*\*bits = 4, got max 5; raise bits$"):
        pack_codes(torch.tensor([0, 5, 3], dtype=torch.uint8), 2)
    assert pack_codes(torch.tensor([255], dtype=torch.uint8), 8).tolist() == [255, 0, 0, 0, 0, 0, 0, 0]
