"""Pack small integer codes (1–8 bits each) densely into bytes, and back.

Data flow: ``pack_codes`` flattens a uint8 code tensor of any shape, pads it with zero codes to a
multiple of 8, and writes the codes as one little-endian bit stream: code ``i`` occupies stream
bits ``[i * bits, (i + 1) * bits)`` with its least significant bit first, and stream bit ``k``
is bit ``k % 8`` of byte ``k // 8``. Every group of 8 codes therefore fills exactly ``bits``
bytes. ``unpack_codes`` reads that stream back and drops the padding; the caller keeps the
original shape and code count.

Both directions expand codes to single bits (one uint8 per bit), so they are fully vectorised,
run on whatever device the input lives on, and use ``8 * bits`` bytes of scratch per 8 codes.
"""

from __future__ import annotations

import torch

__all__ = ["pack_codes", "packed_length", "unpack_codes"]

_MIN_BITS = 1
_MAX_BITS = 8


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not _MIN_BITS <= bits <= _MAX_BITS:
        msg = f"bits must be an int in {_MIN_BITS}..{_MAX_BITS}, got {bits!r}; pick a supported code width"
        raise ValueError(msg)


def packed_length(count: int, bits: int) -> int:
    """Number of bytes ``pack_codes`` produces for ``count`` codes of ``bits`` bits.

    Args:
        count: Number of codes (>= 0).
        bits: Bits per code, 1..8.

    Returns:
        ``ceil(count / 8) * bits``.

    Raises:
        ValueError: If ``bits`` is out of range or ``count`` is negative.
    """
    _check_bits(bits)
    if count < 0:
        msg = f"count must be >= 0, got {count}"
        raise ValueError(msg)
    return (count + 7) // 8 * bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of ``bits`` bits each into a dense little-endian bit stream.

    Args:
        codes: uint8 tensor of any shape (empty allowed) whose values are all ``< 2**bits``.
        bits: Bits per code, 1..8.

    Returns:
        1-D uint8 tensor of length ``ceil(codes.numel() / 8) * bits`` on ``codes.device``. The
        last group is padded with zero codes; with ``bits=8`` the result is a copy of the codes
        plus that padding.

    Raises:
        ValueError: If ``bits`` is not in 1..8 or a code does not fit in ``bits`` bits.
        TypeError: If ``codes`` is not uint8.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        msg = f"codes must be a torch.uint8 tensor, got {codes.dtype}; cast with codes.to(torch.uint8)"
        raise TypeError(msg)
    n = codes.numel()
    # One cheap reduction (a device sync on GPU) guards against silently truncated codes.
    if n and bits < _MAX_BITS and int(codes.max()) >= (1 << bits):
        msg = f"codes must all be < 2**bits = {1 << bits}, got max {int(codes.max())}; raise bits"
        raise ValueError(msg)

    # [n] -> [n_pad]: zero codes fill the last group of 8; cat always copies, so the result never
    # aliases the caller's tensor (bits=8 is exactly that copy).
    flat = codes.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-n) % 8)])
    if bits == _MAX_BITS:
        return flat

    # [n_pad] -> [n_pad, bits]: bit j of every code, LSB first (the stream order).
    code_shifts = torch.arange(bits, dtype=torch.uint8, device=flat.device)
    stream = (flat.unsqueeze(-1) >> code_shifts) & 0b1
    # [n_pad * bits] stream bits -> [n_pad * bits / 8, 8]: 8 consecutive stream bits per byte.
    stream = stream.reshape(-1, 8)
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    # The 8 shifted bits are disjoint, so their sum (<= 255) is their bitwise OR.
    return (stream << byte_shifts).sum(dim=-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`.

    Args:
        packed: 1-D uint8 tensor produced by ``pack_codes(codes, bits)``.
        bits: Bits per code used when packing, 1..8.
        count: Number of codes that were packed (``codes.numel()``).

    Returns:
        1-D uint8 tensor of ``count`` codes, each ``< 2**bits``, on ``packed.device``. Reshape it
        to the original shape yourself.

    Raises:
        ValueError: If ``bits`` is out of range, ``count`` is negative, or ``packed`` is not 1-D
            with exactly ``ceil(count / 8) * bits`` bytes.
        TypeError: If ``packed`` is not uint8.
    """
    expected = packed_length(count, bits)
    if packed.dtype != torch.uint8:
        msg = f"packed must be a torch.uint8 tensor, got {packed.dtype}"
        raise TypeError(msg)
    if packed.dim() != 1 or packed.numel() != expected:
        msg = (
            f"packed has shape {tuple(packed.shape)} but {count} codes of {bits} bits pack into a 1-D "
            f"tensor of {expected} bytes; pass the count and bits used by pack_codes"
        )
        raise ValueError(msg)
    if bits == _MAX_BITS:
        return packed[:count].clone()

    # [n_bytes] -> [n_bytes, 8] stream bits, LSB of each byte first.
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = (packed.unsqueeze(-1) >> byte_shifts) & 0b1
    # [n_bytes * 8] stream bits -> [n_pad, bits]: one row of bits per code, LSB first.
    stream = stream.reshape(-1, bits)
    code_shifts = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    codes = (stream << code_shifts).sum(dim=-1, dtype=torch.uint8)
    return codes[:count]
