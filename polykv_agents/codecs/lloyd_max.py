"""Lloyd–Max scalar quantiser for a standard normal coordinate.

Data flow: after the random rotation a head vector's coordinates are close to N(0, 1), so each
one is quantised with the MSE-optimal ``2**bits``-level quantiser for N(0, 1).
``gaussian_lloyd_max(bits)`` computes its centroids and decision boundaries (midpoints between
neighbouring centroids) as the fixed point of Lloyd's iteration with the closed-form Gaussian
conditional mean, solved by Newton's method (with a plain Lloyd step as fallback);
``quantize_to_codes`` maps values to uint8 codes (index of the nearest centroid) with
``torch.bucketize``, and ``codes_to_values`` maps codes back to centroid values.

Tables are computed in float64 on the CPU once per ``bits`` and cached; the public getters hand
out fresh float32 copies.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["codes_to_values", "gaussian_lloyd_max", "gaussian_lloyd_max_mse", "quantize_to_codes"]

_MIN_BITS = 1
_MAX_BITS = 8
_TOL = 1e-12
_MAX_ITERS = 200
_SQRT2 = math.sqrt(2.0)


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not _MIN_BITS <= bits <= _MAX_BITS:
        msg = f"bits must be an int in {_MIN_BITS}..{_MAX_BITS}, got {bits!r}"
        raise ValueError(msg)


def _pdf(x: torch.Tensor) -> torch.Tensor:
    # exp(-inf) = 0, so the outer cells' infinite edges need no special case.
    return torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cell_mass(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """P(a < X < b) for X ~ N(0, 1), accurate in both tails.

    erf(b) - erf(a) cancels catastrophically when both edges are far out in one tail, so cells
    wholly on one side use the complementary tail, 0.5 * (erfc(|near|) - erfc(|far|)).
    """
    mid = 0.5 * (torch.erf(b / _SQRT2) - torch.erf(a / _SQRT2))
    right = 0.5 * (torch.erfc(a / _SQRT2) - torch.erfc(b / _SQRT2))
    left = 0.5 * (torch.erfc(-b / _SQRT2) - torch.erfc(-a / _SQRT2))
    return torch.where(a >= 0, right, torch.where(b <= 0, left, mid))


def _edges(centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper cell edges ``[K]`` each: midpoints, with ±inf at the ends."""
    mids = 0.5 * (centroids[1:] + centroids[:-1])
    inf = torch.full((1,), math.inf, dtype=centroids.dtype)
    return torch.cat([-inf, mids]), torch.cat([mids, inf])


def _lloyd_map(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Lloyd step ``T(c)`` (cell conditional means) and its tridiagonal Jacobian ``[K, K]``."""
    lo, hi = _edges(c)
    mass = _cell_mass(lo, hi)
    pdf_lo, pdf_hi = _pdf(lo), _pdf(hi)
    # E[X | lo < X < hi] = (pdf(lo) - pdf(hi)) / P(lo < X < hi).
    mean = (pdf_lo - pdf_hi) / mass
    # d mean / d lo = pdf(lo) (mean - lo) / P and d mean / d hi = pdf(hi) (hi - mean) / P (both 0
    # at infinite edges); each edge is the midpoint of two centroids, so each contributes 1/2.
    d_lo = torch.nan_to_num(pdf_lo * (mean - lo) / mass, nan=0.0, posinf=0.0, neginf=0.0)
    d_hi = torch.nan_to_num(pdf_hi * (hi - mean) / mass, nan=0.0, posinf=0.0, neginf=0.0)
    jac = torch.diag(0.5 * (d_lo + d_hi))
    jac += torch.diag(0.5 * d_lo[1:], -1) + torch.diag(0.5 * d_hi[:-1], 1)
    return mean, jac


@functools.cache
def _table_f64(bits: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Cached float64 ``(centroids [K], boundaries [K - 1], mse)``; never hand out uncopied."""
    k = 1 << bits
    # Start from the high-resolution optimum: the optimal point density is proportional to
    # pdf(x)^(1/3), i.e. N(0, 3), whose quantiles are already close to the fixed point.
    p = (torch.arange(k, dtype=torch.float64) + 0.5) / k
    c = math.sqrt(3.0) * _SQRT2 * torch.erfinv(2.0 * p - 1.0)
    eye = torch.eye(k, dtype=torch.float64)
    for _ in range(_MAX_ITERS):
        mean, jac = _lloyd_map(c)
        residual = mean - c
        if float(residual.abs().max()) < _TOL:
            break
        # Plain Lloyd (c <- T(c)) converges linearly and slows down badly as K grows (seconds at
        # 8 bits), so solve T(c) = c by Newton and keep the Lloyd step as the safe fallback.
        step = torch.linalg.solve(eye - jac, residual)
        newton = c + step
        newton = 0.5 * (newton - newton.flip(0))  # keep the table exactly symmetric
        ordered = bool((newton[1:] > newton[:-1]).all())
        if ordered and float((_lloyd_map(newton)[0] - newton).abs().max()) < float(residual.abs().max()):
            c = newton
        else:
            c = 0.5 * (mean - mean.flip(0))
    else:  # pragma: no cover - Newton from the N(0, 3) start converges in under 10 steps
        msg = f"Lloyd iteration for bits={bits} did not converge in {_MAX_ITERS} steps"
        raise RuntimeError(msg)
    lo, hi = _edges(c)
    # Each centroid is its cell's conditional mean, so MSE = E[X^2] - sum_i P_i c_i^2.
    mse = 1.0 - float((_cell_mass(lo, hi) * c * c).sum())
    return c, 0.5 * (c[1:] + c[:-1]), mse


def gaussian_lloyd_max(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids and decision boundaries of the MSE-optimal quantiser for N(0, 1).

    Args:
        bits: Bits per code, 1..8 (``2**bits`` levels).

    Returns:
        ``(centroids, boundaries)``: fresh float32 CPU tensors. ``centroids`` has ``2**bits``
        ascending values symmetric about 0; ``boundaries`` has the ``2**bits - 1`` midpoints
        between consecutive centroids.

    Raises:
        ValueError: If ``bits`` is not in 1..8.
    """
    _check_bits(bits)
    c, bnd, _ = _table_f64(bits)
    return c.to(torch.float32), bnd.to(torch.float32)


def gaussian_lloyd_max_mse(bits: int) -> float:
    """Expected squared error per coordinate of :func:`gaussian_lloyd_max` on N(0, 1) input.

    Args:
        bits: Bits per code, 1..8.

    Returns:
        The MSE, e.g. about 0.3634 (1 bit), 0.1175 (2), 0.03454 (3), 0.009497 (4).

    Raises:
        ValueError: If ``bits`` is not in 1..8.
    """
    _check_bits(bits)
    return _table_f64(bits)[2]


def quantize_to_codes(x: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid for every element of ``x``.

    Code ``i`` means ``boundaries[i - 1] < x <= boundaries[i]``; with midpoint boundaries that is
    the nearest centroid (ties go to the lower one). NaN maps to the highest code.

    Args:
        x: Floating tensor of any shape (values already scaled to the quantiser's N(0, 1) range).
        boundaries: 1-D ascending boundaries, at most 255 of them (from
            :func:`gaussian_lloyd_max`); moved to ``x.device``.

    Returns:
        uint8 tensor shaped like ``x`` with codes in ``0..len(boundaries)``.

    Raises:
        ValueError: If ``x`` is not floating point or ``boundaries`` is not 1-D with <= 255 entries.
    """
    if not x.is_floating_point():
        msg = f"x must be a floating tensor, got {x.dtype}"
        raise ValueError(msg)
    if boundaries.dim() != 1 or boundaries.numel() > 255:
        msg = f"boundaries must be 1-D with at most 255 entries, got shape {tuple(boundaries.shape)}"
        raise ValueError(msg)
    # Compare in float32 (or float64 if x is): rounding boundaries to half precision would shift
    # decision points, so low-precision inputs are upcast instead.
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    bnd = boundaries.to(device=x.device, dtype=work)
    return torch.bucketize(x.to(work), bnd).to(torch.uint8)


def codes_to_values(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Look up the centroid value for every code.

    Args:
        codes: Integer tensor of any shape, every value ``< len(centroids)`` (codes from
            :func:`quantize_to_codes` or ``unpack_codes(..., bits)`` with
            ``len(centroids) == 2**bits`` always are; out-of-range codes are not checked, to keep
            the decode path free of device syncs).
        centroids: 1-D centroid table; moved to ``codes.device``.

    Returns:
        float32 tensor shaped like ``codes``.

    Raises:
        ValueError: If ``codes`` is not an integer tensor or ``centroids`` is not 1-D.
    """
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        msg = f"codes must be an integer tensor, got {codes.dtype}"
        raise ValueError(msg)
    if centroids.dim() != 1:
        msg = f"centroids must be 1-D, got shape {tuple(centroids.shape)}"
        raise ValueError(msg)
    table = centroids.to(device=codes.device, dtype=torch.float32)
    return table[codes.long()]
