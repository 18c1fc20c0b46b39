"""The int8 kernel's vector path (float32 rows, AVX-512 or AVX2) computes the weight-only int8 product, each row's
bits the same alone and beside any others and on either instruction set, in eager mode and inside ``torch.compile``; a
float32 layer stores its codes in the kernel's layout only where the path runs."""

from __future__ import annotations

import pytest
import torch
from native_kernels import require_native_kernel
from torch import nn

from polykv_agents.model import int8_tiles
from polykv_agents.model.int8_tiles import pack, vector_matmul, vectors_available
from polykv_agents.model.quantized_linear import Int8Linear

SHAPES = [(64, 32), (70, 100), (70, 33), (576, 576), (192, 1536)]
"""(out, in) features: one block each way, both padded, an odd input count, the embedded model's projections."""

ROWS = [1, 3, 6, 7, 15, 16, 17, 40, 130]
"""Up to 6 rows (codes widened in registers), more (widened once into a scratch), more than one chunk of 96."""


@pytest.fixture
def vectors():
    require_native_kernel("int8_linear")
    if not vectors_available():
        pytest.skip("this CPU (or this build) has neither AVX-512 nor AVX2: float32 models keep native weights")


def _codes_and_scales(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 100


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_the_vector_path_computes_the_dequantized_product(vectors, shape, rows):
    codes, scales = _codes_and_scales(*shape)
    x = torch.randn(rows, shape[1])
    exact = (x.double() @ (codes.double() * scales.double()[:, None]).T).float()
    out = vector_matmul(x, pack(codes), scales)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=2e-4)  # float32 sums of up to 1,536 terms of ~0.5


@pytest.mark.parametrize("shape", [(576, 576), (70, 33)])
def test_a_row_gets_the_same_bits_alone_and_beside_any_others(vectors, shape):
    """Whatever the step's row count (registers or scratch, one chunk or two), so an agent's tokens do not depend on
    how many agents share its step, nor a prompt's on its admission chunk."""
    codes, scales = _codes_and_scales(*shape, seed=1)
    packed = pack(codes)
    x = torch.randn(max(ROWS), shape[1])
    alone = torch.cat([vector_matmul(x[r : r + 1], packed, scales) for r in range(x.shape[0])])
    for rows in ROWS:
        assert torch.equal(vector_matmul(x[:rows], packed, scales), alone[:rows]), rows
    assert torch.equal(vector_matmul(x[5:29], packed, scales), alone[5:29])  # rows of another step, another order


@pytest.mark.parametrize("rows", [2, 7])
def test_an_odd_input_count_reads_nothing_past_a_row_s_end(vectors, rows):
    """The last pair of an odd K has no second input: its padded code is zero, but a product with the next row's first
    input would still turn an infinity there into NaN for this row."""
    codes, scales = _codes_and_scales(70, 33, seed=3)
    x = torch.randn(rows, 33)
    x[1:, 0] = float("inf")  # every row but the first starts with an infinity
    out = vector_matmul(x, pack(codes), scales)
    assert out[0].isfinite().all()
    assert torch.equal(out[0], vector_matmul(x[:1], pack(codes), scales)[0])


def test_an_avx2_build_gives_the_avx512_build_s_bits(vectors):
    """A laptop without AVX-512 runs the AVX2 build (8 columns an instruction instead of 16); each output is the same
    chain of fused multiply-adds, so it gives the same bits, at every row count."""
    from polykv_agents.kernels import build_for_instructions, native_kernel

    if native_kernel("int8_linear").vector_instructions() != "avx512":
        pytest.skip("the usual build here is not AVX-512's")
    avx2 = build_for_instructions("int8_linear", ["-mno-avx512f"])
    assert avx2.vector_instructions() == "avx2" and not avx2.tiles_available()
    for shape in SHAPES:
        codes, scales = _codes_and_scales(*shape, seed=2)
        packed = pack(codes)
        for rows in ROWS:
            x = torch.randn(rows, shape[1])
            assert torch.equal(avx2.int8_linear_float(x, packed, scales), vector_matmul(x, packed, scales))


def test_the_vector_path_refuses_what_it_cannot_take(vectors):
    codes, scales = _codes_and_scales(64, 64)
    packed = pack(codes)
    with pytest.raises(RuntimeError, match="at least one row"):
        vector_matmul(torch.randn(0, 64), packed, scales)
    with pytest.raises(RuntimeError, match="float32"):
        vector_matmul(torch.randn(2, 64).bfloat16(), packed, scales)
    with pytest.raises(RuntimeError, match="do not fit"):
        vector_matmul(torch.randn(2, 96), packed, scales)


def test_inside_torch_compile_the_registered_operator_gives_the_same_result(vectors):
    layer = Int8Linear(nn.Linear(64, 128))
    x = torch.randn(4, 64)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), layer(x))


def test_a_float32_layer_stores_one_copy_in_the_kernel_layout_and_computes_with_it(vectors, monkeypatch):
    linear = nn.Linear(100, 70, bias=True)
    layer = Int8Linear(linear)
    assert layer.tiled and layer.qweight.dim() == 6 and layer.qweight.nbytes == 128 * 128
    calls = []
    monkeypatch.setattr(int8_tiles, "_kernel", lambda: _Spy(calls))
    x = torch.randn(17, 100)
    prefill, decode = layer(x), torch.cat([layer(row) for row in x.split(16)])
    assert calls == [17, 16, 1]  # a prefill chunk and decode steps, all on the kernel
    assert torch.equal(prefill, decode)
    dense = x @ (layer.codes().float() * layer.scales[:, None]).T + linear.bias
    torch.testing.assert_close(prefill, dense, rtol=1e-5, atol=1e-5)


def test_without_the_kernels_a_float32_layer_keeps_the_plain_layout(monkeypatch):
    monkeypatch.setenv("POLYKV_AGENTS_KERNELS", "0")
    layer = Int8Linear(nn.Linear(64, 48, bias=False))
    assert not layer.tiled and layer.qweight.shape == (48, 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ (layer.codes().float() * layer.scales[:, None]).T, rtol=1e-5, atol=1e-5)


class _Spy:
    """The kernel module, counting the vector path's calls."""

    def __init__(self, calls: list) -> None:
        from polykv_agents.kernels import native_kernel

        self._kernel, self._calls = native_kernel("int8_linear"), calls

    def int8_linear_float(self, *args):
        self._calls.append(args[0].shape[0])
        return self._kernel.int8_linear_float(*args)
