"""TurboQuant-MSE value codec: distortion, the rotation's role, storage, dtypes and metadata."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polykv_agents import codecs
from polykv_agents.codecs.bitpack import unpack_codes
from polykv_agents.codecs.encoded import EncodedTensor
from polykv_agents.codecs.hadamard import rotation_kind
from polykv_agents.codecs.lloyd_max import gaussian_lloyd_max_mse
from polykv_agents.codecs.turboquant import TurboQuantCodec

# Per-coordinate MSE of the Lloyd–Max quantiser of N(0, 1), as quoted by the TurboQuant paper.
PAPER_MSE = {2: 0.1175, 3: 0.0345, 4: 0.0095}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _per_vector_error(x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """||x - dec||² / ||x||² for every head vector, in float32 (``x`` must have no zero vectors)."""
    x32, d32 = x.float(), decoded.float()
    return (x32 - d32).square().sum(-1) / x32.square().sum(-1)


def _normalised_mse(x: torch.Tensor, decoded: torch.Tensor) -> float:
    return float(_per_vector_error(x, decoded).mean())


def _roundtrip(codec: TurboQuantCodec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x))


# --------------------------------------------------------------------------- distortion


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_roundtrip_matches_turboquant_mse(bits: int, head_dim: int) -> None:
    """Normalised MSE on Gaussian head vectors is the Lloyd–Max per-coordinate MSE.

    After normalising and rotating, sqrt(d) times a unit vector has nearly N(0, 1) coordinates, so
    E||x - dec||² / ||x||² equals the quantiser's per-coordinate MSE: 0.1175 / 0.0345 / 0.0095 for
    2 / 3 / 4 bits (TurboQuant, Zandieh et al. 2025). Finite head_dim makes the coordinates
    slightly lighter-tailed than a Gaussian (error a few % lower) and the fp16 norm adds a little
    error, hence 10 % relative plus a small absolute slack. A wrong scale (sqrt(d) missing), a
    non-orthogonal rotation or a wrong codebook would be off by far more.
    """
    x = torch.randn(1, 4, 2048, head_dim, generator=_gen(bits * 1000 + head_dim))
    codec = TurboQuantCodec(bits, seed=7)
    mse = _normalised_mse(x, _roundtrip(codec, x))
    assert mse == pytest.approx(PAPER_MSE[bits], rel=0.10, abs=2e-4)
    assert mse == pytest.approx(gaussian_lloyd_max_mse(bits), rel=0.10, abs=2e-4)


def test_three_bit_error_is_about_0_034() -> None:
    """The default value codec (3 bits) keeps about 3.4 % of a value vector's energy as error."""
    x = torch.randn(1, 4, 2048, 128, generator=_gen(3))
    mse = _normalised_mse(x, _roundtrip(TurboQuantCodec(3), x))
    assert 0.031 < mse < 0.037


def test_more_bits_means_less_error() -> None:
    """Each extra bit cuts the error by roughly 3.4x (2 -> 3 -> 4 bits) on the same data."""
    x = torch.randn(1, 2, 512, 64, generator=_gen(4))
    errors = [_normalised_mse(x, _roundtrip(TurboQuantCodec(b), x)) for b in (2, 3, 4)]
    assert errors[0] > 2.5 * errors[1] > 2.5 * 2.5 * errors[2]


def _shared_offset(head_dim: int, seed: int = 0) -> torch.Tensor:
    """Head vectors dominated by a common offset: 4 * ones + 0.3 * noise (99 % of the energy shared)."""
    return 4.0 * torch.ones(1, 2, 512, head_dim) + 0.3 * torch.randn(1, 2, 512, head_dim, generator=_gen(seed))


def test_random_signs_rescue_a_shared_offset() -> None:
    """With random signs a shared offset costs little; without them it is clipped badly.

    Real value (and key) vectors share a large common component. The all-ones direction is row 0
    of every Hadamard matrix built here, so the plain rotation H.T / sqrt(d) sends ``4 * ones``
    onto coordinate 0 alone: sqrt(d) * y_0 is about sqrt(d) (8 for d = 64), far beyond the last
    Lloyd–Max centroid (2.15 at 3 bits), so almost all of the vector's energy is clipped away,
    while the other coordinates (near 0) are quantised to ±0.245. The seeded ±1 signs first turn
    the offset into a ±4 vector far from every Hadamard row, so its energy is spread over all
    coordinates and the error stays close to the Gaussian figure.
    """
    x = _shared_offset(64)
    with_signs = _normalised_mse(x, _roundtrip(TurboQuantCodec(3, seed=0), x))
    without_signs = _normalised_mse(x, _roundtrip(TurboQuantCodec(3, seed=0, random_signs=False), x))
    assert with_signs < 0.05
    assert without_signs > 0.3
    assert without_signs > 5 * with_signs


def test_rotation_helps_on_outlier_channels() -> None:
    """Skipping the rotation hurts vectors whose energy sits in a few channels.

    Without rotation, sqrt(d) * x / ||x|| for x = noise + 5 on 4 of 64 channels has four coordinates
    near 4 (clipped at the last centroid 2.15) and the rest near 0.3. The rotation spreads the
    outliers over all coordinates, which the N(0, 1) codebook fits.
    """
    x = 0.3 * torch.randn(1, 2, 512, 64, generator=_gen(5))
    x[..., :4] += 5.0
    rotated = _normalised_mse(x, _roundtrip(TurboQuantCodec(3, seed=0), x))
    unrotated = _normalised_mse(x, _roundtrip(TurboQuantCodec(3, seed=0, rotation=False), x))
    assert rotated < 0.05
    assert unrotated > 3 * rotated


def test_rotation_false_is_worse_on_a_shared_offset_at_three_bits() -> None:
    """On the shared-offset data, 3-bit quantisation without rotation is worse than with it.

    (Without rotation every coordinate of sqrt(d) * x / ||x|| is close to 1, between centroids.)
    """
    x = _shared_offset(64)
    rotated = _normalised_mse(x, _roundtrip(TurboQuantCodec(3, seed=0), x))
    unrotated = _normalised_mse(x, _roundtrip(TurboQuantCodec(3, seed=0, rotation=False), x))
    assert unrotated > rotated


@pytest.mark.parametrize("head_dim", [80, 96, 112, 50])
def test_non_power_of_two_head_dims(head_dim: int) -> None:
    """Paley x Sylvester Hadamard orders (80, 96, 112) and the Haar fallback (50) work as well.

    Shape and dtype round-trip, and Gaussian error is the same Lloyd–Max figure as for powers of
    two: any orthogonal rotation makes the coordinates near-Gaussian.
    """
    expected_kind = "haar" if head_dim == 50 else "hadamard"
    assert rotation_kind(head_dim) == expected_kind
    x = torch.randn(1, 2, 1024, head_dim, generator=_gen(head_dim))
    codec = TurboQuantCodec(3, seed=2)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    assert _normalised_mse(x, out) == pytest.approx(PAPER_MSE[3], rel=0.10, abs=2e-4)


def test_random_signs_false_needs_a_hadamard_order() -> None:
    """Without random signs there is no Haar fallback, so an odd-ish order (50) is refused loudly."""
    x = torch.randn(1, 1, 4, 50, generator=_gen(0))
    with pytest.raises(ValueError, match="random_signs=False"):
        TurboQuantCodec(3, random_signs=False).encode(x)


# --------------------------------------------------------------------------- storage


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 3, 4096, 64), (2, 1, 7, 12), (1, 1, 1, 50)])
def test_storage_layout(bits: int, shape: tuple[int, ...]) -> None:
    """Codes are bit-packed (ceil(numel / 8) * bits bytes) and norms are one fp16 per head vector.

    ``EncodedTensor.nbytes`` is what pool size reports rely on, so it must be the sum of the
    stored tensors' bytes.
    """
    x = torch.randn(*shape, generator=_gen(1))
    enc = TurboQuantCodec(bits).encode(x)
    numel = math.prod(shape)
    assert set(enc.tensors) == {"codes", "norms"}
    codes, norms = enc.tensors["codes"], enc.tensors["norms"]
    assert codes.dtype == torch.uint8
    assert codes.dim() == 1
    assert codes.nbytes == math.ceil(numel / 8) * bits
    assert norms.dtype == torch.float16
    assert norms.shape == shape[:-1]
    assert enc.nbytes == codes.nbytes + norms.nbytes
    assert enc.nbytes == sum(t.nbytes for t in enc.tensors.values())
    # Codes unpack to valid codebook indices.
    assert int(unpack_codes(codes, bits, numel).max()) < (1 << bits)


def test_three_bit_storage_is_3_25_bits_per_element_at_head_dim_64() -> None:
    """3-bit codes cost at most 3.25 bits per element on a realistic shape (exactly 3 here), and
    with the 16-bit norm per 64-dim vector the total is exactly 3.25 bits per element."""
    shape = (1, 3, 4096, 64)
    enc = TurboQuantCodec(3).encode(torch.randn(*shape, generator=_gen(2)))
    numel = math.prod(shape)
    code_bits_per_element = 8 * enc.tensors["codes"].nbytes / numel
    assert code_bits_per_element <= 3.25
    assert 8 * enc.nbytes / numel == pytest.approx(3.0 + 16 / 64)


def test_norms_are_the_vector_norms() -> None:
    """The stored norm of each head vector is its L2 norm (rounded to fp16)."""
    x = torch.randn(1, 2, 5, 64, generator=_gen(3)) * 3
    enc = TurboQuantCodec(3).encode(x)
    assert torch.allclose(enc.tensors["norms"].float(), x.norm(dim=-1), rtol=1e-3)


# --------------------------------------------------------------------------- dtypes and metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_returns_the_original_dtype_and_honours_override(dtype: torch.dtype) -> None:
    """The record remembers the model's dtype; ``decode(enc, dtype=...)`` overrides it."""
    x = torch.randn(1, 2, 9, 64, generator=_gen(4)).to(dtype)
    codec = TurboQuantCodec(3)
    enc = codec.encode(x)
    assert enc.dtype == str(dtype).removeprefix("torch.")
    assert codec.decode(enc).dtype == dtype
    as_f32 = codec.decode(enc, dtype=torch.float32)
    assert as_f32.dtype == torch.float32
    assert codec.decode(enc, dtype=torch.float64).dtype == torch.float64
    # The override changes the dtype only, not the values (beyond the target dtype's rounding).
    assert torch.allclose(codec.decode(enc).float(), as_f32, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "codec",
    [
        TurboQuantCodec(2, seed=3),
        TurboQuantCodec(3, seed=11, random_signs=False),
        TurboQuantCodec(4, seed=5, rotation=False),
    ],
    ids=["tq2", "tq3-nosigns", "tq4-norot"],
)
def test_record_is_self_describing(codec: TurboQuantCodec) -> None:
    """The registry rebuilds the codec from the record's metadata alone and decodes identically.

    Pools persist only tensors plus a JSON header, so bits, seed, rotation and random_signs must
    all be in ``params``; a missing or ignored one would rebuild a different rotation/codebook.
    """
    x = torch.randn(2, 2, 6, 64, generator=_gen(5)).to(torch.bfloat16)
    enc = codec.encode(x)
    assert enc.codec == "turboquant"
    assert dict(enc.params) == {
        "bits": codec.bits,
        "seed": codec.seed,
        "rotation": codec.rotation,
        "random_signs": codec.random_signs,
    }
    assert enc.shape == tuple(x.shape)
    assert torch.equal(codecs.decode(enc), codec.decode(enc))
    assert torch.equal(codecs.decode(enc, torch.float32), codec.decode(enc, torch.float32))


def test_registry_rejects_unknown_codec_names() -> None:
    """A record from an unknown codec fails with a message naming it, not a KeyError."""
    enc = TurboQuantCodec(3).encode(torch.randn(1, 1, 2, 8, generator=_gen(0)))
    bogus = EncodedTensor(codec="zstd", shape=enc.shape, dtype=enc.dtype, params={}, tensors=enc.tensors)
    with pytest.raises(ValueError, match="zstd"):
        codecs.decode(bogus)


def test_same_seed_same_codes_different_seed_different_codes() -> None:
    """Codes are a deterministic function of (data, seed): the seed alone rebuilds the rotation."""
    x = torch.randn(1, 2, 32, 64, generator=_gen(6))
    a = TurboQuantCodec(3, seed=1).encode(x).tensors["codes"]
    b = TurboQuantCodec(3, seed=1).encode(x).tensors["codes"]
    c = TurboQuantCodec(3, seed=2).encode(x).tensors["codes"]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_wrong_seed_decodes_garbage() -> None:
    """Decoding with another seed's rotation gives a large error: the seed really matters."""
    x = torch.randn(1, 2, 64, 64, generator=_gen(7))
    enc = TurboQuantCodec(3, seed=1).encode(x)
    wrong = TurboQuantCodec(3, seed=2).decode(enc)
    assert _normalised_mse(x, wrong) > 0.5


def test_zero_vectors_decode_to_zero() -> None:
    """All-zero head vectors (e.g. padding) decode to exact zeros, not NaN, next to normal ones."""
    x = torch.randn(1, 2, 4, 64, generator=_gen(8))
    x[0, 1, 2] = 0
    x[0, 0] = 0
    out = _roundtrip(TurboQuantCodec(3), x)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 1, 2], torch.zeros(64))
    assert torch.equal(out[0, 0], torch.zeros(4, 64))


def test_zero_tokens_round_trip() -> None:
    """An empty token axis encodes to empty tensors and decodes to the same empty shape."""
    x = torch.zeros(1, 2, 0, 64)
    enc = TurboQuantCodec(3).encode(x)
    assert enc.nbytes == 0
    assert TurboQuantCodec(3).decode(enc).shape == x.shape


@pytest.mark.parametrize("shape", [(4, 64), (1, 2, 3, 4, 64)])
def test_non_4d_input_is_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="batch, kv_heads, tokens, head_dim"):
        TurboQuantCodec(3).encode(torch.zeros(shape))


@pytest.mark.parametrize("bits", [1, 5, 8])
def test_unsupported_bits_are_rejected(bits: int) -> None:
    """Only 2/3/4-bit codebooks are supported; others fail at construction."""
    with pytest.raises(ValueError, match=f"bits={bits}"):
        TurboQuantCodec(bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_overflowing_fp16_is_not_silently_corrupted(dtype: torch.dtype) -> None:
    """A vector with norm 8e4 (> fp16 max 65504) must either decode finite or be refused loudly."""
    x = torch.full((1, 1, 2, 64), 1e4, dtype=dtype)  # norm = 1e4 * 8 = 8e4
    codec = TurboQuantCodec(3)
    try:
        enc = codec.encode(x)
    except ValueError:
        return
    assert torch.isfinite(codec.decode(enc)).all()


# --------------------------------------------------------------------------- property test

HEAD_DIMS = [8, 12, 16, 20, 24, 32, 48, 64, 80, 96, 112, 128]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 4),
    tokens=st.integers(1, 40),
    head_dim=st.sampled_from(HEAD_DIMS),
    bits=st.sampled_from([2, 3, 4]),
    dtype=st.sampled_from(DTYPES),
    data_seed=st.integers(0, 2**16),
    codec_seed=st.integers(0, 3),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    outlier=st.booleans(),
    zero_first_token=st.booleans(),
)
def test_roundtrip_properties(
    batch: int,
    heads: int,
    tokens: int,
    head_dim: int,
    bits: int,
    dtype: torch.dtype,
    data_seed: int,
    codec_seed: int,
    scale: float,
    outlier: bool,
    zero_first_token: bool,
) -> None:
    """Any shape/bits/dtype: decode has the input's shape and dtype, is finite, zero vectors stay
    zero, and no nonzero vector loses more than half its energy (a loose sanity bound: Gaussian
    vectors lose about 12 % at 2 bits, and the worst case for these inputs stays below 0.45)."""
    x = scale * torch.randn(batch, heads, tokens, head_dim, generator=_gen(data_seed))
    if outlier:  # a key-like outlier channel
        x[..., data_seed % head_dim] *= 20
    if zero_first_token:
        x[:, :, 0] = 0
    x = x.to(dtype)
    codec = TurboQuantCodec(bits, seed=codec_seed)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.shape == x.shape
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    nonzero = x.float().norm(dim=-1) > 0
    assert torch.equal(out[~nonzero].float(), torch.zeros_like(out[~nonzero].float()))
    errors = _per_vector_error(x[nonzero], codec.decode(enc, dtype=torch.float32)[nonzero])
    assert bool((errors < 0.5).all()), float(errors.max())


@pytest.mark.parametrize("value", [1e4, math.inf, math.nan])
def test_huge_or_non_finite_norms_are_refused(value: float) -> None:
    """A norm beyond fp16 (here 8e4), inf or NaN is refused with a message that names the cause."""
    x = torch.randn(1, 1, 2, 64, generator=_gen(9))
    x[0, 0, 1] = value
    with pytest.raises(
        ValueError,
        match=(
            r"^a head vector's norm is non-finite or exceeds the fp16 range \(65504\); "
            r"the model produced non-finite or huge activations$"
        ),
    ):
        TurboQuantCodec(3).encode(x)


def test_defaults_are_three_bits_seed_zero_with_signed_rotation() -> None:
    codec = TurboQuantCodec()
    assert (codec.bits, codec.seed, codec.rotation, codec.random_signs) == (3, 0, True, True)
    assert codec.centroids.shape == (8,)


@pytest.mark.parametrize("flag", ["rotation", "random_signs"])
def test_non_boolean_flags_are_rejected(flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        TurboQuantCodec(3, **{flag: "sometimes"})
