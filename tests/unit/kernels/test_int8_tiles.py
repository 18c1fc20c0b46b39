"""The int8 tile kernel computes the weight-only int8 product, row by row as if each row were alone, in eager
mode and inside ``torch.compile``; a layer stores its codes in the kernel's layout only where the kernel runs."""

from __future__ import annotations

import pytest
import torch
from native_kernels import require_native_kernel
from torch import nn

from polykv_agents.model import int8_tiles
from polykv_agents.model.int8_tiles import TILE_MAX_ROWS, pack, tile_matmul, tiles_available, unpack, unpack_rows
from polykv_agents.model.quantized_linear import Int8Linear

SHAPES = [(64, 32), (70, 100), (576, 576), (192, 1536)]
"""(out, in) features: one block each way, both padded, and the embedded model's projection shapes."""


@pytest.fixture
def tiles():
    require_native_kernel("int8_linear")
    if not tiles_available():
        pytest.skip("this CPU (or this build) has no AMX tiles: int8 weights keep PyTorch's kernels")


def _codes_and_scales(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 100


@pytest.mark.parametrize("shape", SHAPES)
def test_packing_is_undone_exactly_and_pads_with_zeros(shape):
    codes, _ = _codes_and_scales(*shape)
    packed = pack(codes)
    assert torch.equal(unpack(packed, *shape), codes)
    assert packed.numel() == -(-shape[0] // 64) * 64 * -(-shape[1] // 32) * 32
    assert packed.abs().sum() == codes.abs().sum()  # the padding holds nothing


@pytest.mark.parametrize("shape", SHAPES)
def test_chosen_rows_are_read_from_the_layout_as_unpacking_gives_them(shape):
    """An embedding lookup over a tied output layer's codes: any rows, repeated, in any order."""
    codes, _ = _codes_and_scales(*shape)
    rows = torch.tensor([shape[0] - 1, 0, 17 % shape[0], shape[0] // 2, 0, 63 % shape[0]])
    assert torch.equal(unpack_rows(pack(codes), rows, shape[1]), codes[rows])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 40])
def test_the_kernel_computes_the_dequantized_product_rounded_once(tiles, shape, rows):
    codes, scales = _codes_and_scales(*shape)
    x = torch.randn(rows, shape[1]).bfloat16()
    exact = (x.double() @ (codes.double() * scales.double()[:, None]).T).float()
    out = tile_matmul(x, pack(codes), scales)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
    # bfloat16's rounding of the result (half a unit in the last place, 2^-9 relative) plus float32 sums.
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-4)


@pytest.mark.parametrize("rows", [TILE_MAX_ROWS, 40])
def test_a_row_gets_the_same_bits_alone_and_beside_others(tiles, rows):
    """So an agent's tokens do not depend on how many agents share its step, nor a prompt's on its chunk."""
    codes, scales = _codes_and_scales(576, 576, seed=1)
    packed = pack(codes)
    x = torch.randn(rows, 576).bfloat16()
    together = tile_matmul(x, packed, scales)
    for r in range(rows):
        assert torch.equal(tile_matmul(x[r : r + 1], packed, scales), together[r : r + 1])


def test_the_kernel_refuses_what_it_cannot_take(tiles):
    codes, scales = _codes_and_scales(64, 64)
    packed = pack(codes)
    with pytest.raises(RuntimeError, match="at least one row"):
        tile_matmul(torch.randn(0, 64).bfloat16(), packed, scales)
    with pytest.raises(RuntimeError, match="bfloat16"):
        tile_matmul(torch.randn(2, 64), packed, scales)
    with pytest.raises(RuntimeError, match="do not fit"):
        tile_matmul(torch.randn(2, 96).bfloat16(), packed, scales)


def test_inside_torch_compile_the_registered_operator_gives_the_same_result(tiles):
    layer = Int8Linear(nn.Linear(64, 128).bfloat16())
    x = torch.randn(4, 64).bfloat16()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), layer(x))


def test_a_bfloat16_layer_stores_one_copy_in_the_tile_layout_and_computes_with_it(tiles, monkeypatch):
    linear = nn.Linear(100, 70, bias=True).bfloat16()
    layer = Int8Linear(linear)
    assert layer.tiled and layer.qweight.dim() == 6 and layer.scales.dtype == torch.float32
    assert layer.qweight.nbytes == 128 * 128  # one copy of the codes, padded to whole blocks
    calls = []
    monkeypatch.setattr(int8_tiles, "_kernel", lambda: _Spy(calls))
    x = torch.randn(TILE_MAX_ROWS + 1, 100).bfloat16()
    prefill, decode = layer(x), torch.cat([layer(row) for row in x.split(TILE_MAX_ROWS)])
    assert calls == [TILE_MAX_ROWS + 1, TILE_MAX_ROWS, 1]  # a prefill chunk and decode steps, all on the kernel
    assert torch.equal(prefill, decode)
    dense = x.float() @ (layer.codes().float() * layer.scales[:, None]).T + linear.bias.float()
    torch.testing.assert_close(prefill.float(), dense, rtol=2**-7, atol=1e-2)  # the bias added in bfloat16


def test_the_tiles_switch_keeps_a_bfloat16_layer_in_the_plain_layout(tiles, monkeypatch):
    monkeypatch.setenv("POLYKV_AGENTS_TILES", "0")
    layer = Int8Linear(nn.Linear(64, 64).bfloat16())
    assert not layer.tiled and layer.qweight.shape == (64, 64) and layer.scales.dtype == torch.bfloat16


class _Spy:
    """The kernel module, counting its calls."""

    def __init__(self, calls: list) -> None:
        from polykv_agents.kernels import native_kernel

        self._kernel, self._calls = native_kernel("int8_linear"), calls

    def int8_linear(self, *args):
        self._calls.append(args[0].shape[0])
        return self._kernel.int8_linear(*args)
