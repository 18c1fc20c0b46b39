"""Lloyd–Max quantiser for N(0, 1): published tables, exact MSE, and the code mapping."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from polykv_agents.codecs import lloyd_max
from polykv_agents.codecs.lloyd_max import (
    codes_to_values,
    gaussian_lloyd_max,
    gaussian_lloyd_max_mse,
    quantize_to_codes,
)

# Positive halves of the centroid tables and the per-coordinate MSE (TurboQuant paper).
PUBLISHED_CENTROIDS = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3439, 2.1519],
    4: [0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
}
PUBLISHED_MSE = {1: 0.363, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_centroids_match_published(bits: int) -> None:
    centroids, _ = gaussian_lloyd_max(bits)
    half = torch.tensor(PUBLISHED_CENTROIDS[bits])
    expected = torch.cat([-half.flip(0), half])
    assert centroids.dtype == torch.float32
    assert centroids.shape == (1 << bits,)
    assert torch.allclose(centroids, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("bits", range(1, 9))
def test_table_shape_symmetry_and_midpoints(bits: int) -> None:
    centroids, boundaries = gaussian_lloyd_max(bits)
    assert centroids.shape == (1 << bits,)
    assert boundaries.shape == ((1 << bits) - 1,)
    assert boundaries.dtype == torch.float32
    assert bool((centroids[1:] > centroids[:-1]).all())
    assert torch.allclose(centroids, -centroids.flip(0), atol=1e-7)
    assert torch.allclose(boundaries, 0.5 * (centroids[1:] + centroids[:-1]), atol=1e-7)


def test_one_bit_is_exact() -> None:
    # One bit: centroids ±E|X| = ±sqrt(2/pi), MSE = 1 - 2/pi.
    centroids, boundaries = gaussian_lloyd_max(1)
    assert math.isclose(float(centroids[1]), math.sqrt(2 / math.pi), rel_tol=1e-6)
    assert float(boundaries[0]) == 0.0
    assert math.isclose(gaussian_lloyd_max_mse(1), 1 - 2 / math.pi, rel_tol=1e-9)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_matches_published(bits: int) -> None:
    assert math.isclose(gaussian_lloyd_max_mse(bits), PUBLISHED_MSE[bits], rel_tol=0.02)


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_high_resolution_mse_matches_panter_dite(bits: int) -> None:
    # At high rates the optimal MSE approaches (sqrt(3) pi / 2) 4**-bits from below (3.0%, 1.6%,
    # 0.8% short of it at 6, 7, 8 bits).
    mse = gaussian_lloyd_max_mse(bits)
    panter_dite = math.sqrt(3) * math.pi / 2 * 4.0**-bits
    assert 0.96 * panter_dite < mse < panter_dite


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_empirical_mse_matches_theory(bits: int) -> None:
    centroids, boundaries = gaussian_lloyd_max(bits)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(bits))
    codes = quantize_to_codes(x, boundaries)
    assert codes.dtype == torch.uint8
    assert codes.shape == x.shape
    assert int(codes.max()) < (1 << bits)
    x_hat = codes_to_values(codes, centroids)
    assert x_hat.dtype == torch.float32
    empirical = float((x - x_hat).square().mean())
    assert math.isclose(empirical, gaussian_lloyd_max_mse(bits), rel_tol=0.03)


def test_codes_are_nearest_centroids() -> None:
    centroids, boundaries = gaussian_lloyd_max(3)
    x = torch.randn(4, 5, 64, generator=torch.Generator().manual_seed(0)) * 2
    codes = quantize_to_codes(x, boundaries)
    assert codes.shape == x.shape
    nearest = (x.unsqueeze(-1) - centroids).abs().argmin(dim=-1)
    assert torch.equal(codes.long(), nearest)
    assert torch.equal(codes_to_values(codes, centroids), centroids[nearest])


def test_quantize_handles_low_and_high_precision_inputs() -> None:
    centroids, boundaries = gaussian_lloyd_max(2)
    x = torch.tensor([-3.0, -1.0, -0.2, 0.2, 1.0, 3.0])
    expected = [0, 0, 1, 2, 3, 3]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert quantize_to_codes(x.to(dtype), boundaries).tolist() == expected
    # Any integer code dtype works for the lookup.
    assert codes_to_values(torch.tensor([0, 3], dtype=torch.int64), centroids).tolist() == [
        float(centroids[0]),
        float(centroids[3]),
    ]


def test_tables_are_fresh_copies() -> None:
    centroids, boundaries = gaussian_lloyd_max(2)
    centroids.zero_()
    boundaries.zero_()
    again, _ = gaussian_lloyd_max(2)
    assert float(again[-1]) > 1.5


@pytest.mark.parametrize("bits", [0, 9])
def test_bits_out_of_range(bits: int) -> None:
    with pytest.raises(ValueError, match="bits"):
        gaussian_lloyd_max(bits)
    with pytest.raises(ValueError, match="bits"):
        gaussian_lloyd_max_mse(bits)


def test_argument_errors() -> None:
    centroids, boundaries = gaussian_lloyd_max(2)
    with pytest.raises(ValueError, match="x"):
        quantize_to_codes(torch.zeros(3, dtype=torch.int64), boundaries)
    with pytest.raises(ValueError, match="boundaries"):
        quantize_to_codes(torch.zeros(3), boundaries.reshape(1, 3))
    with pytest.raises(ValueError, match="boundaries"):
        quantize_to_codes(torch.zeros(3), torch.zeros(256))
    with pytest.raises(ValueError, match="codes"):
        codes_to_values(torch.zeros(3), centroids)
    with pytest.raises(ValueError, match="centroids"):
        codes_to_values(torch.zeros(3, dtype=torch.uint8), centroids.reshape(2, 2))


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _normal_pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_uncached_solve_is_the_lloyd_fixed_point(bits: int) -> None:
    """Solve the table afresh (bypassing the per-process cache that codecs built at import may
    have filled) and check it against an independent scalar computation: every centroid is the
    conditional mean of its cell, cells are split at midpoints, and the MSE is 1 - sum P_i c_i^2.
    """
    centroids, boundaries, mse = lloyd_max._table_f64.__wrapped__(bits)
    assert centroids.dtype == boundaries.dtype == torch.float64
    c = centroids.tolist()
    assert len(c) == 1 << bits
    assert boundaries.tolist() == [0.5 * (lo + hi) for lo, hi in itertools.pairwise(c)]
    edges = [-math.inf, *boundaries.tolist(), math.inf]
    masses = [_normal_cdf(b) - _normal_cdf(a) for a, b in itertools.pairwise(edges)]
    means = [(_normal_pdf(a) - _normal_pdf(b)) / p for (a, b), p in zip(itertools.pairwise(edges), masses, strict=True)]
    assert c == pytest.approx(means, abs=1e-9)
    assert c == [-v for v in reversed(c)]
    assert mse == pytest.approx(1.0 - sum(p * v * v for p, v in zip(masses, c, strict=True)), abs=1e-9)
    if bits in PUBLISHED_CENTROIDS:
        assert c[1 << (bits - 1) :] == pytest.approx(PUBLISHED_CENTROIDS[bits], abs=1e-4)
        assert mse == pytest.approx(PUBLISHED_MSE[bits], rel=2e-3)


def test_three_bit_table_to_four_decimals() -> None:
    centroids, boundaries = gaussian_lloyd_max(3)
    assert centroids.tolist() == pytest.approx(
        [-2.1519, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1519], abs=1e-4
    )
    assert boundaries.tolist() == pytest.approx([-1.7479, -1.0500, -0.5006, 0.0, 0.5006, 1.0500, 1.7479], abs=1e-4)
    assert gaussian_lloyd_max_mse(3) == pytest.approx(0.03454, abs=1e-5)


def _reference_mass(a: float, b: float) -> float:
    """P(a < X < b) from the upper tail of whichever side is smaller (no cancellation)."""
    if a >= 0:
        return 0.5 * (math.erfc(a / math.sqrt(2.0)) - math.erfc(b / math.sqrt(2.0)))
    if b <= 0:
        return _reference_mass(-b, -a)
    return 1.0 - _reference_mass(-math.inf, a) - _reference_mass(b, math.inf)


def test_cell_mass_is_the_normal_probability_in_the_middle_and_both_tails() -> None:
    # The solver's cells never straddle 0 (the middle boundary is exactly 0), so straddling cells
    # are checked here directly, next to far-tail cells where erf(b) - erf(a) would round to 0.
    cells = [(-1.0, 0.5), (-0.3, 2.0), (-math.inf, math.inf), (-2.0, -1.0), (1.0, 2.0), (8.0, 9.0), (-9.0, -8.0)]
    lo = torch.tensor([a for a, _ in cells], dtype=torch.float64)
    hi = torch.tensor([b for _, b in cells], dtype=torch.float64)
    mass = lloyd_max._cell_mass(lo, hi).tolist()
    assert mass == pytest.approx([_reference_mass(a, b) for a, b in cells], rel=1e-12)
    assert mass[-1] == mass[-2] > 0


def test_code_lookup_dtypes() -> None:
    centroids, _ = gaussian_lloyd_max(2)
    codes = torch.tensor([[3, 0], [1, 2]], dtype=torch.uint8)
    # The result is float32 whatever the table's dtype.
    values = codes_to_values(codes, centroids.double())
    assert values.dtype == torch.float32
    assert torch.equal(values, centroids[codes.long()])
    with pytest.raises(ValueError, match=r"^codes must be an integer tensor, got torch\.bool$"):
        codes_to_values(torch.zeros(3, dtype=torch.bool), centroids)
    with pytest.raises(ValueError, match=r"^codes must be an integer tensor, got torch\.complex64$"):
        codes_to_values(torch.zeros(3, dtype=torch.complex64), centroids)


def test_comparisons_happen_in_the_documented_working_precision() -> None:
    """float64 input is compared in float64, everything else in float32 (boundaries included).

    Half inputs are upcast rather than the boundaries rounded down: 0.500488 (the float16 just
    above 0.5) lies above a 0.5004 boundary, which float16 would round up to the input itself.
    """
    half = torch.tensor([0.500488], dtype=torch.float16)
    assert quantize_to_codes(half, torch.tensor([0.5004])).tolist() == [1]
    assert quantize_to_codes(torch.tensor([0.5 + 1e-12], dtype=torch.float64), torch.tensor([0.5])).tolist() == [1]
    # A float64 table is rounded to float32 for float32 input: 0.5 - 1e-12 becomes 0.5 >= x.
    assert quantize_to_codes(torch.tensor([0.5]), torch.tensor([0.5 - 1e-12], dtype=torch.float64)).tolist() == [0]


@pytest.mark.parametrize("bits", [True, 3.0])
def test_bits_must_be_a_plain_int(bits: object) -> None:
    for getter in (gaussian_lloyd_max, gaussian_lloyd_max_mse):
        with pytest.raises(ValueError, match=r"^bits must be an int in 1\.\.8, got "):
            getter(bits)  # type: ignore[arg-type]
