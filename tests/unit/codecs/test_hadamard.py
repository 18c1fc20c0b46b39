"""Hadamard constructions and the seeded random rotation built on them."""

from __future__ import annotations

import math

import pytest
import torch

from polykv_agents.codecs import hadamard
from polykv_agents.codecs.hadamard import (
    MAX_ROTATION_DIM,
    hadamard_matrix,
    has_hadamard,
    random_rotation,
    rotation_kind,
)

CONSTRUCTIBLE = [n for n in range(1, 257) if has_hadamard(n)]


def _orthogonality_error(r: torch.Tensor) -> float:
    eye = torch.eye(r.shape[0], dtype=r.dtype)
    return max(float((r @ r.T - eye).abs().max()), float((r.T @ r - eye).abs().max()))


def test_expected_orders_are_constructible() -> None:
    for n in (1, 2, 4, 8, 12, 16, 20, 24, 28, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256):
        assert has_hadamard(n), n
    # Odd orders, 2 mod 4, and orders that need prime-power Paley (52 = 2 * (25 + 1), 92).
    for n in (0, -4, 3, 5, 6, 7, 10, 50, 52, 92, 100):
        assert not has_hadamard(n), n
    assert len(CONSTRUCTIBLE) >= 50


@pytest.mark.parametrize("n", CONSTRUCTIBLE)
def test_hadamard_property(n: int) -> None:
    h = hadamard_matrix(n)
    assert h.shape == (n, n)
    assert h.dtype == torch.float64
    assert bool(((h == 1) | (h == -1)).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_hadamard_matrix_returns_a_copy() -> None:
    h = hadamard_matrix(12)
    h.zero_()
    assert hadamard_matrix(12).abs().min() == 1


@pytest.mark.parametrize("n", [0, 7, 52, 4097])
def test_hadamard_matrix_rejects_unbuildable_orders(n: int) -> None:
    with pytest.raises(ValueError, match=r"n must|no Hadamard"):
        hadamard_matrix(n)


HADAMARD_DIMS = [1, 12, 64, 80, 96, 112, 128]  # power-of-two and Paley x Sylvester orders
HAAR_DIMS = [7, 50, 52]  # odd, 2 mod 4, and a prime-power Paley order: Haar fallback


@pytest.mark.parametrize("dim", HADAMARD_DIMS + HAAR_DIMS)
def test_random_rotation_is_orthogonal(dim: int) -> None:
    kind = "hadamard" if dim in HADAMARD_DIMS else "haar"
    assert rotation_kind(dim) == kind
    r = random_rotation(dim, seed=3)
    assert r.shape == (dim, dim)
    assert r.dtype == torch.float32
    assert _orthogonality_error(r) < 1e-5
    x = torch.randn(5, dim, generator=torch.Generator().manual_seed(0))
    assert torch.allclose((x @ r) @ r.T, x, atol=1e-5)
    if kind == "hadamard":
        # Every entry is ±1/sqrt(dim): each output mixes all inputs with equal weight.
        assert torch.allclose(r.abs(), torch.full_like(r, 1 / math.sqrt(dim)))


@pytest.mark.parametrize("dim", [128, 96, 7])
def test_random_rotation_is_deterministic_per_seed(dim: int) -> None:
    a = random_rotation(dim, seed=11)
    assert torch.equal(a, random_rotation(dim, seed=11))
    assert not torch.equal(a, random_rotation(dim, seed=12))


def test_random_rotation_structure_and_signs() -> None:
    # R = diag(s) @ H.T / sqrt(dim): R / (H.T / sqrt(dim)) is constant along each row, = s_i.
    dim = 96
    plain = hadamard_matrix(dim).T / math.sqrt(dim)
    r = random_rotation(dim, seed=5, dtype=torch.float64)
    signs = (r / plain)[:, 0]
    assert torch.equal(r, signs.unsqueeze(1) * plain)
    assert bool((signs.abs() == 1).all())
    assert 0 < int((signs < 0).sum()) < dim  # both signs occur
    assert torch.equal(random_rotation(dim, seed=5, random_signs=False, dtype=torch.float64), plain)


def test_random_rotation_dtype_device_and_copy() -> None:
    r = random_rotation(16, seed=0, dtype=torch.float64, device="cpu")
    assert r.dtype == torch.float64
    assert r.device.type == "cpu"
    r.zero_()  # must not corrupt the cache
    assert _orthogonality_error(random_rotation(16, seed=0, dtype=torch.float64)) < 1e-12
    assert random_rotation(16, seed=0, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dim", [128, 96])
def test_random_signs_spread_a_shared_offset(dim: int) -> None:
    """Without random signs, a shared offset lands in one coordinate; with them it spreads.

    Real keys/values often share a large common component. Take x = 3 * ones(dim) + 0.1 * noise.
    Row 0 of every Hadamard matrix built here is all ones, so the plain rotation H.T / sqrt(dim)
    maps the offset onto coordinate 0 alone (y_0 = 3 sqrt(dim)): nearly all of ||y||² sits in one
    coordinate, which a per-coordinate N(0, 1) quantiser then clips badly. Random signs first turn
    the offset into a ±3 vector that is far from every Hadamard row, so its energy is spread over
    all coordinates (the largest coordinate holds well under a fifth of it).
    """
    gen = torch.Generator().manual_seed(0)
    x = 3.0 * torch.ones(64, dim) + 0.1 * torch.randn(64, dim, generator=gen)

    def max_energy_share(y: torch.Tensor) -> torch.Tensor:
        return y.square().amax(dim=-1) / y.square().sum(dim=-1)

    plain = max_energy_share(x @ random_rotation(dim, seed=1, random_signs=False))
    signed = max_energy_share(x @ random_rotation(dim, seed=1))
    assert float(plain.min()) > 0.99
    assert float(signed.max()) < 0.2


def test_random_rotation_argument_errors() -> None:
    with pytest.raises(ValueError, match="dim"):
        random_rotation(0, seed=0)
    with pytest.raises(ValueError, match="dim"):
        random_rotation(4097, seed=0)
    with pytest.raises(ValueError, match="seed"):
        random_rotation(8, seed=-1)
    with pytest.raises(ValueError, match="dtype"):
        random_rotation(8, seed=0, dtype=torch.int32)
    with pytest.raises(
        ValueError,
        match=(
            r"^random_signs=False needs a Hadamard matrix of order 7, and none can be built; use random_signs=True "
            r"\(Haar fallback\) or a Hadamard order such as a power of two$"
        ),
    ):
        random_rotation(7, seed=0, random_signs=False)
    with pytest.raises(ValueError, match="dim"):
        rotation_kind(0)


def test_error_messages_name_the_argument_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^dim must be an int in 1\.\.4096, got 0$"):
        rotation_kind(0)
    with pytest.raises(ValueError, match=r"^n must be an int in 1\.\.4096, got 4097$"):
        hadamard_matrix(4097)
    with pytest.raises(
        ValueError,
        match=(
            r"^no Hadamard matrix of order 52 can be built here \(Sylvester, prime Paley I/II and "
            r"their products with powers of two\); use random_rotation, which falls back to Haar$"
        ),
    ):
        hadamard_matrix(52)


def _legendre(x: int, q: int) -> int:
    """chi(x) mod a prime q by Euler's criterion (independent of the squares table in the module)."""
    r = pow(x % q, (q - 1) // 2, q)
    return {0: 0, 1: 1, q - 1: -1}[r]


def _textbook_paley(m: int, kind: str) -> list[list[float]]:
    """Paley I (prime ``q = m - 1 ≡ 3 mod 4``) or II (prime ``q = m / 2 - 1 ≡ 1 mod 4``), entry by entry."""
    if kind == "I":  # H = I + S, S = [[0, 1ᵀ], [-1, Q]], Q[i, j] = chi(j - i)
        q = m - 1
        s = [[0] * m for _ in range(m)]
        for j in range(1, m):
            s[0][j], s[j][0] = 1, -1
        for i in range(1, m):
            for j in range(1, m):
                s[i][j] = _legendre(j - i, q)
        return [[float(s[i][j] + (i == j)) for j in range(m)] for i in range(m)]
    # H = C ⊗ [[1, -1], [-1, -1]] + I ⊗ [[1, 1], [1, -1]], C = [[0, 1ᵀ], [1, Q]]
    q = m // 2 - 1
    c = [[0] * (q + 1) for _ in range(q + 1)]
    for j in range(1, q + 1):
        c[0][j] = c[j][0] = 1
    for i in range(1, q + 1):
        for j in range(1, q + 1):
            c[i][j] = _legendre(j - i, q)
    a, b = [[1, -1], [-1, -1]], [[1, 1], [1, -1]]
    return [
        [float(c[i // 2][j // 2] * a[i % 2][j % 2] + (i // 2 == j // 2) * b[i % 2][j % 2]) for j in range(m)]
        for i in range(m)
    ]


@pytest.mark.parametrize(
    ("n", "paley_order", "kind"),
    [(12, 12, "I"), (20, 20, "I"), (28, 28, "II"), (36, 36, "II"), (24, 12, "I"), (112, 28, "II")],
)
def test_hadamard_matrix_is_the_textbook_construction(n: int, paley_order: int, kind: str) -> None:
    """The exact matrix is part of the storage format: a record stores the seed, not the rotation.

    I - S (the transpose) and C ⊗ A - I ⊗ B are Hadamard matrices too, so the Hadamard property
    alone would not notice if the construction switched to them and old pools decoded wrongly.
    Orders 12, 20 are Paley I, 28, 36 Paley II; 24 = 12 x 2 and 112 = 28 x 4 put the Paley
    factor outside: ``kron(paley, sylvester)``.
    """
    expected = torch.kron(
        torch.tensor(_textbook_paley(paley_order, kind), dtype=torch.float64), hadamard_matrix(n // paley_order)
    )
    assert torch.equal(hadamard_matrix(n), expected)
    sylvester_4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64)
    assert torch.equal(hadamard_matrix(4), sylvester_4)


def test_is_prime_and_paley_kind() -> None:
    primes = [q for q in range(60) if hadamard._is_prime(q)]
    assert primes == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
    # Paley I: q = m - 1 prime and 3 mod 4; Paley II: q = m / 2 - 1 prime and 1 mod 4.
    kinds = {m: hadamard._paley_kind(m) for m in (4, 8, 12, 20, 24, 28, 36, 44, 52, 60, 76)}
    assert kinds == {
        4: "I",
        8: "I",
        12: "I",
        20: "I",
        24: "I",
        28: "II",
        36: "II",
        44: "I",
        52: None,
        60: "I",
        76: "II",
    }


@pytest.mark.parametrize("bad", [True, 2.0, "8"])
def test_non_int_orders_are_refused(bad: object) -> None:
    assert not has_hadamard(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^dim must be an int in 1\.\.4096"):
        rotation_kind(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^n must be an int in 1\.\.4096"):
        hadamard_matrix(bad)  # type: ignore[arg-type]


def test_largest_order_and_seed_bounds() -> None:
    assert rotation_kind(MAX_ROTATION_DIM) == "hadamard"
    assert MAX_ROTATION_DIM == 4096
    with pytest.raises(ValueError, match=r"^dim must be an int in 1\.\.4096, got 0$"):
        random_rotation(0, seed=0)
    largest = random_rotation(8, seed=2**63 - 1)
    assert _orthogonality_error(largest) < 1e-6
    assert torch.equal(random_rotation(8, seed=127), random_rotation(8, seed=127))  # 127 > 2 * 63: a power bounds it
    for seed in (2**63, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"^seed must be an int in 0\.\.2\*\*63 - 1, got "):
            random_rotation(8, seed=seed)  # type: ignore[arg-type]
