"""The dtype a model computes in. ``dtype="auto"`` (the default) picks bf16 where the hardware has it natively.

On a CPU with AVX-512 bf16 or AMX, bf16 weights halve the bytes every step reads and run the matrix
products in native instructions (``python -m benchmarks dtype`` measures prefill, decode steps and
perplexity in both dtypes side by side; docs/RESULTS.md). A CPU without them would emulate bf16, slower
than fp32, so ``auto`` keeps fp32 there. On CUDA, ``auto`` is bf16 where the GPU supports it, else fp16.

A pool does not depend on the dtype: it holds codes, and the model's fingerprint leaves the dtype out,
so a pool built by an fp32 model serves a bf16 one and the other way round. Reading a pool in the dtype
that built it is best (the same suite measures the perplexity cost of crossing).

``POLYKV_DTYPE`` (``float32``, ``bfloat16``, ``float16`` or ``auto``) says what ``auto`` means in this
process, for example to pin a test run or a benchmark to fp32; an explicit dtype always wins.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
"""The dtypes a model can be asked for by name."""

DTYPE_ENV_VAR = "POLYKV_DTYPE"
"""Environment variable that says what ``dtype="auto"`` means (``auto``: the hardware decides)."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bf16 natively: AVX-512 bf16 or AMX on a CPU, bf16 support on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """What ``auto`` resolves to on ``device`` when ``POLYKV_DTYPE`` does not say otherwise."""
    if native_bf16(device):
        return torch.bfloat16
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype | None:
    """A concrete dtype for ``dtype`` on ``device``; ``None`` stays ``None`` (the checkpoint's own dtype).

    Raises:
        ValueError: An unknown name, here or in ``POLYKV_DTYPE``.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = os.environ.get(DTYPE_ENV_VAR, "auto").strip() or "auto"
        if dtype == "auto":
            return auto_dtype(device)
        return _named(dtype, source=DTYPE_ENV_VAR)
    return _named(dtype, source="dtype")


def _named(name: str, *, source: str) -> torch.dtype:
    if name not in DTYPES:
        msg = f"{source} must be one of 'auto', {', '.join(repr(n) for n in DTYPES)}; got {name!r}"
        raise ValueError(msg)
    return DTYPES[name]
