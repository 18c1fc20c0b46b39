"""int8 weights laid out for the native kernel ``int8_linear`` (AMX tiles), which reads them once per product.

PyTorch's ``_weight_int8pack_mm`` reads the weight matrix again for every few rows: one decode step's products of
the embedded SmolLM2 (bf16, int8 weights from memory, every layer in turn) took 13.4 ms at 1 row, 16.6 at 4,
30.8 at 8 and 47.2 at 15, against 27-28 ms in bf16. The kernel widens each int8 code to bfloat16 in a tile's
scratch and multiplies it with every row at once: 10-11 ms at 1 to 16 rows (``python -m benchmarks.probes.
int8_matmul``, results in ``benchmarks/results/issue42/int8_matmul.json``). It computes what the dequantized
product computes (weight-only int8: the activations stay bfloat16), so quality is that of ``weights="int8"``.

A row's result does not depend on the other rows of its call (each output is its own sum, in a fixed order), so
an agent's tokens are the same whether it decodes alone or beside 15 others.

A prefill chunk runs through it too: a column block's codes are widened once and multiplied with every 16 rows.
Prefilling a 2,782-token pool with int8 weights took 2.4-2.6 s this way, against 3.0 s widening the whole weight
for an ordinary matrix product (the way before the kernel) and 3.7 s unpacking this layout first.

The layout (``[N_pad / 64, K_pad / 32, 4, 16, 16, 2]``, ``polykv_agents/kernels/int8_linear.cpp``) replaces the
``[N, K]`` codes: :class:`~polykv_agents.model.quantized_linear.Int8Linear` keeps one copy of them.
"""

from __future__ import annotations

import torch

from polykv_agents.kernels import TILES_SWITCH, native_kernel, switched_on

TILE_MAX_ROWS = 16
"""Rows of one tile: up to this many (a decode step's agents) take the time of one row."""

_K_BLOCK, _N_BLOCK = 32, 64


def tiles_available() -> bool:
    """Whether the kernel is built, this CPU has AMX bfloat16 tiles granted by the OS, and ``POLYKV_AGENTS_TILES``
    does not switch them off. Decided when a layer is quantized: its weights are stored in the kernel's layout."""
    if not switched_on(TILES_SWITCH):
        return False
    kernel = native_kernel("int8_linear")
    return kernel is not None and kernel.available()


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


def tile_matmul(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows [M, K]`` bf16 times the weights ``packed`` codes x ``scales [N]`` (float32): ``[M, N]`` bf16.

    Eager calls go straight to the kernel (a custom operator's dispatch costs about 10 us, 2 ms a step for the
    embedded model's 211 products); inside ``torch.compile`` the registered operator stands in for it."""
    if torch.compiler.is_compiling():
        return torch.ops.polykv.int8_linear(rows, packed, scales)
    return native_kernel("int8_linear").int8_linear(rows, packed, scales)


@torch.library.custom_op("polykv::int8_linear", mutates_args=())
def _int8_linear(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return native_kernel("int8_linear").int8_linear(rows, packed, scales)


@_int8_linear.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], scales.shape[0])
