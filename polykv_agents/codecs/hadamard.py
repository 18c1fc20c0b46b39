"""Hadamard matrices and the seeded random rotation that spreads a head vector's energy.

Data flow: ``random_rotation(dim, seed)`` returns an orthogonal ``[dim, dim]`` matrix ``R`` that
codecs apply to row vectors, ``y = x @ R`` for ``x`` of shape ``[..., dim]``, and undo with
``x = y @ R.T``. When a Hadamard matrix ``H`` of order ``dim`` can be built, ``R = diag(s) @ H.T /
sqrt(dim)``: the input is multiplied by seeded random signs ``s`` and then mixed by the normalised
Hadamard matrix, so every output coordinate is a ±1/sqrt(dim) combination of all inputs and
looks Gaussian whatever the input. Otherwise (odd ``dim``, or orders no construction here
reaches) ``R`` is a Haar-random orthogonal matrix from the same seed; ``rotation_kind`` says which.

Hadamard orders come from Sylvester (powers of two), Paley I (``q + 1`` for a prime
``q ≡ 3 mod 4``), Paley II (``2 (q + 1)`` for a prime ``q ≡ 1 mod 4``), and Kronecker products of
one Paley matrix with a Sylvester matrix. Everything is built in float64 on the CPU, cached, and
cast/moved (as a fresh copy) on return, so callers may modify what they receive.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["MAX_ROTATION_DIM", "hadamard_matrix", "has_hadamard", "random_rotation", "rotation_kind"]

# A float64 rotation of this order is 128 MiB; larger ones are almost surely a mistake (head_dim).
MAX_ROTATION_DIM = 4096


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % p for p in range(2, math.isqrt(q) + 1))


def _paley_kind(m: int) -> str | None:
    """Which Paley construction builds order ``m`` directly ("I", "II"), or None."""
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "I"
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "II"
    return None


def _decompose(n: int) -> tuple[int, int] | None:
    """Split ``n = 2**k * m`` with ``m`` 1 or a Paley order; return ``(2**k, m)`` or None.

    Tries the largest power of two first, so powers of two are pure Sylvester and the Paley
    factor stays as small as possible.
    """
    if n < 1:
        return None
    two_power = n & -n  # largest power of two dividing n
    while two_power >= 1:
        m = n // two_power
        if m == 1 or _paley_kind(m) is not None:
            return two_power, m
        two_power //= 2
    return None


def _check_order(n: int, name: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ROTATION_DIM:
        msg = f"{name} must be an int in 1..{MAX_ROTATION_DIM}, got {n!r}"
        raise ValueError(msg)


def has_hadamard(n: int) -> bool:
    """Whether :func:`hadamard_matrix` can build a Hadamard matrix of order ``n``.

    Args:
        n: Matrix order.

    Returns:
        True for 1, 2, powers of two, Paley orders and their products with powers of two
        (e.g. 12, 20, 24, 28, 40, 48, 56, 80, 96, 112, 160, 192), False otherwise (including
        ``n < 1`` and orders that need prime-power Paley constructions, such as 52 or 92).
    """
    if isinstance(n, bool) or not isinstance(n, int):
        return False
    return _decompose(n) is not None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h, h2)
    return h


def _jacobsthal(q: int) -> torch.Tensor:
    """``[q, q]`` Jacobsthal matrix ``Q[i, j] = chi(j - i)``, chi the Legendre symbol mod q."""
    chi = -torch.ones(q, dtype=torch.float64)
    chi[0] = 0.0
    squares = torch.arange(1, q, dtype=torch.int64) ** 2 % q
    chi[squares] = 1.0
    idx = torch.arange(q)
    return chi[(idx.unsqueeze(0) - idx.unsqueeze(1)) % q]


def _paley(m: int, kind: str) -> torch.Tensor:
    if kind == "I":
        # q ≡ 3 mod 4: Q is antisymmetric, S = [[0, 1ᵀ], [-1, Q]] is skew, H = I + S.
        q = m - 1
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:] = 1.0
        s[1:, 0] = -1.0
        s[1:, 1:] = _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s
    # q ≡ 1 mod 4: Q is symmetric, C = [[0, 1ᵀ], [1, Q]] is a symmetric conference matrix and
    # H = C ⊗ [[1, -1], [-1, -1]] + I ⊗ [[1, 1], [1, -1]] has order 2 (q + 1).
    q = m // 2 - 1
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1.0
    c[1:, 0] = 1.0
    c[1:, 1:] = _jacobsthal(q)
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


@functools.lru_cache(maxsize=32)
def _hadamard_f64(n: int) -> torch.Tensor:
    """Cached float64 CPU Hadamard matrix; never hand it out without copying."""
    parts = _decompose(n)
    assert parts is not None, n
    two_power, m = parts
    h = _sylvester(two_power)
    if m > 1:
        kind = _paley_kind(m)
        assert kind is not None, m
        h = torch.kron(_paley(m, kind), h)
    # H @ H.T == n I is proven by the constructions and checked for every order <= 256 in tests;
    # an O(n^3) check here would cost seconds at n = 4096.
    assert h.shape == (n, n), (h.shape, n)
    return h


def hadamard_matrix(n: int) -> torch.Tensor:
    """A Hadamard matrix of order ``n``: ±1 entries and ``H @ H.T == n * I``.

    Args:
        n: Matrix order, 1..MAX_ROTATION_DIM, with ``has_hadamard(n)`` true.

    Returns:
        A fresh float64 CPU tensor of shape ``[n, n]`` (a copy of a cached matrix).

    Raises:
        ValueError: If ``n`` is out of range or no construction here reaches order ``n``.
    """
    _check_order(n, "n")
    if not has_hadamard(n):
        msg = (
            f"no Hadamard matrix of order {n} can be built here (Sylvester, prime Paley I/II and "
            "their products with powers of two); use random_rotation, which falls back to Haar"
        )
        raise ValueError(msg)
    return _hadamard_f64(n).clone()


def rotation_kind(dim: int) -> str:
    """The kind of matrix :func:`random_rotation` returns for ``dim``.

    Args:
        dim: Rotation order, 1..MAX_ROTATION_DIM.

    Returns:
        ``"hadamard"`` (sign-randomised normalised Hadamard) or ``"haar"`` (Haar-random
        orthogonal fallback).

    Raises:
        ValueError: If ``dim`` is out of range.
    """
    _check_order(dim, "dim")
    return "hadamard" if has_hadamard(dim) else "haar"


@functools.lru_cache(maxsize=64)
def _rotation_f64(dim: int, seed: int, random_signs: bool) -> torch.Tensor:
    """Cached float64 CPU rotation; never hand it out without copying."""
    # A CPU generator makes the matrix identical across runs and devices.
    gen = torch.Generator().manual_seed(seed)
    if has_hadamard(dim):
        h = _hadamard_f64(dim)
        if random_signs:
            signs = torch.randint(0, 2, (dim,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        else:
            signs = torch.ones(dim, dtype=torch.float64)
        # diag(s) @ H.T / sqrt(dim): scale row i of H.T by s_i.
        return signs.unsqueeze(1) * h.T / math.sqrt(dim)
    assert random_signs, dim
    # Haar measure: QR of a Gaussian matrix, with Q's columns sign-fixed by diag(R) so that the
    # distribution does not depend on the QR implementation's sign convention.
    gauss = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    fix = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)
    return q * fix


def random_rotation(
    dim: int,
    seed: int,
    *,
    random_signs: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A seeded orthogonal ``[dim, dim]`` matrix ``R``, applied as ``y = x @ R``, undone as ``y @ R.T``.

    For Hadamard orders ``R = diag(s) @ H.T / sqrt(dim)`` with ``s`` drawn as ±1 from
    ``torch.Generator().manual_seed(seed)`` (all ones when ``random_signs=False``). For other
    orders (e.g. odd ``dim``) ``R`` is a Haar-random orthogonal matrix from the same generator:
    dense, so applying it costs the same matmul but has no fast-transform structure. See
    :func:`rotation_kind`. The result is deterministic in ``(dim, seed, random_signs)`` and
    independent of ``device``.

    Args:
        dim: Vector length (head_dim), 1..MAX_ROTATION_DIM.
        seed: Generator seed, an int in ``0 .. 2**63 - 1``.
        random_signs: Draw the random sign diagonal. Without it the rotation is the plain
            normalised Hadamard matrix, which leaves inputs near a Hadamard row (e.g. a shared
            constant offset) concentrated in one coordinate.
        dtype: Floating dtype of the result (built in float64, then cast).
        device: Device of the result.

    Returns:
        A fresh ``[dim, dim]`` tensor (safe to modify) with ``R @ R.T ≈ I``.

    Raises:
        ValueError: If ``dim`` or ``seed`` is out of range, ``dtype`` is not floating point, or
            ``random_signs=False`` for a ``dim`` without a Hadamard matrix.
    """
    _check_order(dim, "dim")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        msg = f"seed must be an int in 0..2**63 - 1, got {seed!r}"
        raise ValueError(msg)
    if not dtype.is_floating_point:
        msg = f"dtype must be a floating dtype, got {dtype}; use e.g. torch.float32"
        raise ValueError(msg)
    if not random_signs and not has_hadamard(dim):
        msg = (
            f"random_signs=False needs a Hadamard matrix of order {dim}, and none can be built; "
            "use random_signs=True (Haar fallback) or a Hadamard order such as a power of two"
        )
        raise ValueError(msg)
    return _rotation_f64(dim, seed, random_signs).to(device=device, dtype=dtype, copy=True)
