"""Weight-only int8 and int4 linear layers on PyTorch's own CPU kernels and one of this package's.

A decode step multiplies a few rows (one per agent) by every weight matrix of the model, so its time is
the time to read the weights. PyTorch ships CPU kernels that read quantized weights directly:

- ``aten._weight_int8pack_mm``: int8 weights ``[N, K]``, one scale per output channel;
- ``aten._weight_int4pack_mm_for_cpu``: int4 weights in groups of 32 along the input, each group with a
  scale and a zero (tinygemm's format: ``w = (code - 8) * scale + zero``).

``python -m benchmarks weights`` measures them per projection against the native layer, with the weights
read from memory as in a decode step (docs/RESULTS.md, weights): at one row they take a fraction of the
bf16 time; they are written for matrix-vector work, so at 15 rows they are about even and at 512 rows (a
prefill chunk) slower. So:

- :class:`Int8Linear`, in a bfloat16 model on a CPU with AMX tiles, stores its codes in the layout of the native
  kernel ``int8_linear`` (:mod:`~polykv_agents.model.int8_tiles`), which reads each weight once for up to 16 rows:
  one step's products of the embedded model took 10.1 ms at 1 row and 10.7 at 15 against 12.3 and 45.9 ms with
  ``_weight_int8pack_mm``, whose cost grows by a pass over the weights every 4 rows (the int8 probe, below). In a
  float32 model on a CPU with AVX-512 or AVX2 it stores them in the same layout for the kernel's vector path
  (float32 rows, :func:`~polykv_agents.model.int8_tiles.vector_matmul`; ``benchmarks.probes.fp32_int8`` measures
  it).
  Elsewhere it uses ``_weight_int8pack_mm`` up to :data:`KERNEL_MAX_ROWS` rows. Above that (a prefill chunk) it
  widens the weight to the activations' dtype for an ordinary matrix product, which reads the weight once for
  hundreds of rows;
- :class:`Int4Linear` has only its packed codes (keeping a second copy would cost what int8 costs), so it
  uses the kernel at every row count: decoding is as fast as int8, prefill is slower. The kernel is fast
  only with bf16 (or fp16) activations: with fp32 ones it took 0.95 ms for one row of a 576 -> 1536
  projection on this project's machine against 0.04 ms in bf16, and 446 ms against 4.5 ms for 512 rows. So
  in an fp32 model it runs in bf16 and returns fp32: the activations are rounded to bf16 at its input, an
  error far below the int4 codes' own.

Why not torchao (0.18, tried first): in eager mode its int8 weight-only tensor dequantizes the whole
weight at every call, which made a decode step about three times slower than bf16 here, and its CPU int4
tensor calls the same kernel as :class:`Int4Linear` through a tensor subclass, which adds a dispatch per
call. Calling PyTorch's kernels directly keeps both costs out of the step.
"""

from __future__ import annotations

import torch
from torch import nn

from polykv_agents.model.int8_tiles import kernel_runs, pack, tile_matmul, unpack, vector_matmul

KERNEL_MAX_ROWS = 16
"""Up to this many rows, an :class:`Int8Linear` without the tile kernel runs ``_weight_int8pack_mm``; above, it
widens the weight for a matrix product. One step's products took 45.9 ms at 15 rows with the kernel against 63.4
ms widened, and 73.6 against 67.0 at 32 rows (``python -m benchmarks.probes.int8_matmul``,
``benchmarks/results/issue42/int8_matmul.json``): the widening, a pass that writes the weight in bfloat16, costs
more than the kernel's extra passes over it up to about 32 rows. bf16 weights kept as such took 26.4 ms."""

INT4_GROUP_SIZE = 32
"""Input features per int4 group (one scale and zero each): the block size of GGUF's Q4_0/Q4_1, so the
embedded model's own 4-bit weights are represented again almost exactly."""


class _QuantizedLinear(nn.Module):
    """What both layers share: shapes, the bias, and flattening the leading dimensions."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # kept as it was (a Parameter or None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]``."""
        rows = x.reshape(-1, self.in_features)  # [M, K]
        out = self._matmul(rows.contiguous())  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


QUANTIZE_ROWS = 4096
"""Output channels quantized at a time: a large matrix's float32 temporaries stay a few MiB (the embedded model's
output head, 49,152 x 576, passed through three of 108 MiB at once, the load's peak RSS)."""


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes for ``weight [N, K]``, one scale per row: ``(codes [N, K] int8, scales [N])``, the scales
    in ``weight``'s dtype; :data:`QUANTIZE_ROWS` rows at a time."""
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=weight.dtype)
    for start in range(0, weight.shape[0], QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        full = weight[rows].float()
        # The smallest normal number of the stored dtype: an all-zero row (pruned, padding) needs a scale that
        # survives the cast, or its codes would be 0 / 0.
        row_scales = (full.abs().amax(dim=1) / 127).clamp_min(torch.finfo(weight.dtype).tiny)
        row_scales = row_scales.to(weight.dtype).float()  # the codes are chosen against the scale that is stored
        codes[rows] = torch.round(full / row_scales[:, None]).clamp(-127, 127)  # whole numbers: cast exactly
        scales[rows] = row_scales
    return codes, scales


class Int8Linear(_QuantizedLinear):
    """A linear layer with symmetric int8 weights, one scale per output channel.

    Buffers: ``qweight`` the int8 codes, ``[N, K]``, or where the native kernel runs (:attr:`tiled`: a bfloat16
    model on a CPU with AMX tiles, or a float32 one on a CPU with AVX-512 or AVX2,
    :func:`~polykv_agents.model.int8_tiles.kernel_runs`) in its layout (:mod:`~polykv_agents.model.int8_tiles`);
    ``scales [N]`` in the model's dtype, float32 when tiled (the same values: the kernel scales its float sums).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach()
        codes, scales = quantize_rows_int8(weight)
        self.tiled = kernel_runs(weight.dtype, weight.device)
        self.kernel_dtype = weight.dtype  # the rows the kernel takes: bfloat16 on its tiles, float32 on its vectors
        self.register_buffer("qweight", pack(codes) if self.tiled else codes)
        self.register_buffer("scales", scales.float() if self.tiled else scales)

    def codes(self) -> torch.Tensor:
        """The int8 codes ``[N, K]`` (unpacked from the tile layout where :attr:`tiled`)."""
        return unpack(self.qweight, self.out_features, self.in_features) if self.tiled else self.qweight

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.tiled and rows.dtype == self.kernel_dtype:  # first: 211 calls a step, nothing else to do
            matmul = tile_matmul if rows.dtype == torch.bfloat16 else vector_matmul
            return matmul(rows, self.qweight, self.scales)
        scales = self.scales.to(rows.dtype)
        if not self.tiled and rows.shape[0] <= KERNEL_MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, scales)
        return nn.functional.linear(rows, self.codes().to(rows.dtype)) * scales


class Int4Linear(_QuantizedLinear):
    """A linear layer with asymmetric int4 weights in groups of :data:`INT4_GROUP_SIZE` input features.

    Buffers: ``packed`` (the kernel's layout of the ``[N, K]`` codes), ``scales_and_zeros [K / 32, N, 2]``
    in :attr:`compute_dtype`: the model's dtype, or bf16 for an fp32 model (the kernel's fp32 path is about
    100x slower, see the module's notes). Needs ``K`` divisible by 32 and ``N`` by 16 (:func:`int4_supported`).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        if not int4_supported(linear):
            msg = f"int4 weights need in_features % {INT4_GROUP_SIZE} == 0 and out_features % 16 == 0, got {linear}"
            raise ValueError(msg)
        weight = linear.weight.detach()
        self.compute_dtype = torch.bfloat16 if weight.dtype == torch.float32 else weight.dtype
        n, k = weight.shape
        groups = weight.float().view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)  # [N, K/32, 32]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/32]
        # Scale and zero rounded to the stored dtype first, so the codes are chosen against them.
        stored = self.compute_dtype
        scales = ((high - low) / 15).clamp_min(torch.finfo(stored).tiny).to(stored).float()
        zeros = (low + 8 * scales).to(stored).float()
        codes = torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15)
        codes = codes.to(torch.int32).view(n, k)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(stored))

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(self.compute_dtype), self.packed, INT4_GROUP_SIZE, self.scales_and_zeros
        )
        return out.to(rows.dtype)


def int4_supported(linear: nn.Linear) -> bool:
    """Whether the int4 kernel takes ``linear``'s shape."""
    return linear.in_features % INT4_GROUP_SIZE == 0 and linear.out_features % 16 == 0
