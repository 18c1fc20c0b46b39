"""int8 weights laid out for the native kernel ``int8_linear``, which reads them once per product: on AMX tiles for
bfloat16 rows, with AVX-512 or AVX2 vectors for float32 rows.

PyTorch's ``_weight_int8pack_mm`` reads the weight matrix again for every few rows. The kernel widens each int8
code to bfloat16 in a tile's scratch and multiplies it with every row at once. One decode step's 211 products of
the embedded SmolLM2 (bf16, int8 weights read from memory, every layer in turn) took 10.1 ms at 1 row and 10.7 at
15 with the kernel, against 12.3 and 45.9 with ``_weight_int8pack_mm`` and 24.2 and 26.4 in bf16 (``python -m
benchmarks.probes.int8_matmul``; ``benchmarks/results/issue42/int8_matmul.json`` names its commit and machine).

It computes what the dequantized product computes (weight-only int8: the activations stay bfloat16), rounded to
bfloat16 once: perplexity +0.12% [-0.23, +0.46] against the native model in the same probe.

A row's result does not depend on the other rows of its call (each output is its own sum, in a fixed order), so
an agent's tokens are the same whether it decodes alone or beside 15 others.

A prefill chunk runs through it too: a column block's codes are widened once and multiplied with every 16 rows
(the weights suite, ``python -m benchmarks weights``, times the prefill with each weight format).

**Float32 rows** (a model in float32: a CPU without AVX-512 bf16 or AMX, where ``dtype="auto"`` is float32) take the
kernel's vector path, :func:`vector_matmul`, on any CPU with AVX-512 or AVX2 (the same bits on both): the same layout,
each code widened to float32 in registers (a few rows) or once per column block into a scratch in the core's cache (more
rows), and every output summed by fused multiply-adds over the inputs in their order. So a row's result is the same bits
alone or beside any other rows, which PyTorch's int8 kernel is not fast enough to give on float32 rows (a scalar loop)
and bfloat16-rounded rows did not give (docs/RUNTIME.md, "Which weights by default"). It computes the dequantized
weight's product in float32 (the activations are not quantized).

The layout (``[N_pad / 64, K_pad / 32, 4, 16, 16, 2]``, ``polykv_agents/kernels/int8_linear.cpp``) replaces the
``[N, K]`` codes: :class:`~polykv_agents.model.quantized_linear.Int8Linear` keeps one copy of them.
"""

from __future__ import annotations

import functools

import torch

from polykv_agents.kernels import kernel_tiles_available, native_kernel

TILE_MAX_ROWS = 16
"""Rows of one tile: up to this many (a decode step's agents) take the time of one row."""

_K_BLOCK, _N_BLOCK = 32, 64

PROFILE_LABEL = "polykv::int8_linear"
"""What a profiler records an eager call of either path under (a step profile counts it with the weights' products);
the registered operators, which compiled steps call, carry this name and ``polykv::int8_linear_float``."""


def tiles_available() -> bool:
    """Whether the kernel is built, this CPU has AMX bfloat16 tiles granted by the OS, and ``POLYKV_AGENTS_TILES``
    does not switch them off. Decided when a layer is quantized: its weights are stored in the kernel's layout."""
    return kernel_tiles_available("int8_linear")


def vectors_available() -> bool:
    """Whether the kernel is built with its vector path (a CPU with AVX-512 or AVX2): float32 rows x int8 codes."""
    kernel = native_kernel("int8_linear")
    return kernel is not None and kernel.vectors_available()


def kernel_runs(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the kernel multiplies rows of ``dtype`` on ``device`` here: bfloat16 on AMX tiles
    (:func:`tiles_available`) or float32 with AVX-512 or AVX2 (:func:`vectors_available`), on the CPU. Decided when
    a layer is quantized: its codes are then stored in the kernel's layout."""
    if torch.device(device).type != "cpu":
        return False
    return (dtype == torch.bfloat16 and tiles_available()) or (dtype == torch.float32 and vectors_available())


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` int8 -> the kernel's layout ``[N_pad / 64, K_pad / 32, 4, 16, 16, 2]`` (zero padded)."""
    n, k = codes.shape
    n_pad, k_pad = -(-n // _N_BLOCK) * _N_BLOCK, -(-k // _K_BLOCK) * _K_BLOCK
    padded = torch.nn.functional.pad(codes, (0, k_pad - k, 0, n_pad - n))
    # [n / 64, (n % 64) / 16, n % 16, k / 32, (k % 32) / 2, k % 2] -> column block, k block, tile, pair, column, k % 2
    blocks = padded.view(n_pad // _N_BLOCK, 4, 16, k_pad // _K_BLOCK, 16, 2)
    return blocks.permute(0, 3, 1, 4, 2, 5).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`pack`'s inverse: ``[N, K]`` int8 codes (a new tensor)."""
    n_blocks, k_blocks = packed.shape[:2]
    return packed.permute(0, 2, 4, 1, 3, 5).reshape(n_blocks * _N_BLOCK, k_blocks * _K_BLOCK)[:n, :k]


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The codes of the rows ``rows [T]`` (indices into ``N``) of :func:`pack`'s layout: ``[T, K]`` int8, reading only
    those rows (an embedding lookup over a tied output layer's codes)."""
    # Row n lives at [n / 64, every k block, (n % 64) / 16, every pair, n % 16, both of k % 2].
    picked = packed[rows // _N_BLOCK, :, (rows % _N_BLOCK) // 16, :, rows % 16, :]  # [T, K_pad / 32, 16, 2]
    return picked.reshape(rows.shape[0], packed.shape[1] * _K_BLOCK)[:, :k]


def tile_matmul(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows [M, K]`` bf16 times the weights ``packed`` codes x ``scales [N]`` (float32): ``[M, N]`` bf16.

    Eager calls go straight to the kernel (a custom operator's dispatch costs about 10 us, 2 ms a step for the
    embedded model's 211 products), under :data:`PROFILE_LABEL` while a profiler records; inside ``torch.compile``
    the registered operator stands in for it."""
    if torch.compiler.is_compiling():
        return torch.ops.polykv.int8_linear(rows, packed, scales)
    if _profiling():
        with torch.profiler.record_function(PROFILE_LABEL):
            return _kernel().int8_linear(rows, packed, scales)
    return _kernel().int8_linear(rows, packed, scales)


def vector_matmul(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows [M, K]`` float32 times the weights ``packed`` codes x ``scales [N]`` (float32): ``[M, N]`` float32, the
    kernel's vector path (eager calls go straight to it, as in :func:`tile_matmul`)."""
    if torch.compiler.is_compiling():
        return torch.ops.polykv.int8_linear_float(rows, packed, scales)
    if _profiling():
        with torch.profiler.record_function(PROFILE_LABEL):
            return _kernel().int8_linear_float(rows, packed, scales)
    return _kernel().int8_linear_float(rows, packed, scales)


def _profiling() -> bool:
    """Whether a profiler records (PyTorch's own flag; where a version lacks it, calls are not labelled)."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", False)


@functools.cache
def _kernel():
    """The built kernel, looked up once: a layer stored in its layout needs it whatever the switches say later."""
    return native_kernel("int8_linear")


@torch.library.custom_op("polykv::int8_linear", mutates_args=())
def _int8_linear(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _kernel().int8_linear(rows, packed, scales)


@_int8_linear.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], scales.shape[0])


@torch.library.custom_op("polykv::int8_linear_float", mutates_args=())
def _int8_linear_float(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _kernel().int8_linear_float(rows, packed, scales)


@_int8_linear_float.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], scales.shape[0])
