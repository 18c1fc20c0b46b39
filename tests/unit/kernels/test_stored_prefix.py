"""The kernel over a prefix read as the pool stores it (int8 keys, TurboQuant values) equals attention over that pool
decoded, and its AMX tile path equals its vector path within bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch
from native_kernels import require_native_kernel

from polykv_agents.codecs import decode
from polykv_agents.codecs.int_linear import IntLinearCodec
from polykv_agents.codecs.turboquant import TurboQuantCodec
from polykv_agents.pool.shared_pool import EncodedLayer
from polykv_agents.runtime.grouped_attention import KernelGroup, grouped_attention, tiles_available
from polykv_agents.runtime.stored_prefix import has_stored_form, stored_layer


@pytest.fixture
def built():
    require_native_kernel("grouped_attention")


def _layer(gen, *, kv_heads, tokens, dim, bits=3, granularity="channel", rotation=True) -> EncodedLayer:
    # Keys with channels of very different sizes, as models' keys have: the per-channel scale matters.
    keys = torch.randn(1, kv_heads, tokens, dim, generator=gen) * (torch.rand(1, kv_heads, 1, dim, generator=gen) * 4)
    values = torch.randn(1, kv_heads, tokens, dim, generator=gen)
    key_codec = IntLinearCodec(bits=8, granularity=granularity)
    return EncodedLayer(key_codec.encode(keys), TurboQuantCodec(bits, seed=7, rotation=rotation).encode(values))


def _groups(gen, layer, *, rows, width, groups, suffix, dtype):
    """The same rows over the stored layer and over the layer decoded in float32 (cast to ``dtype``)."""
    _, kv_heads, _, dim = layer.keys.shape
    query = torch.randn(1, rows * width, kv_heads * groups, dim, generator=gen).transpose(1, 2)[0]  # [H, N, D]
    suffix_keys, suffix_values = (torch.randn(rows, kv_heads, suffix, dim, generator=gen) for _ in range(2))
    past = torch.randint(0, suffix - width + 1, (rows,), generator=gen)
    starts = torch.minimum(torch.randint(0, 3, (rows,), generator=gen), past)
    own = (query.to(dtype), suffix_keys.to(dtype), suffix_values.to(dtype))
    stored = KernelGroup(own[0], None, None, own[1], own[2], starts, past, width, stored_layer(layer))
    decoded_keys, decoded_values = decode(layer.keys, torch.float32), decode(layer.values, torch.float32)
    reference = KernelGroup(query, decoded_keys, decoded_values, suffix_keys, suffix_values, starts, past, width)
    return stored, reference


CASES = [
    # kv heads, tokens, head dim, value bits, key scale granularity, rotated values, rows, width, heads per kv head
    (3, 300, 64, 3, "channel", True, 2, 1, 3),  # the default codecs; two chunks of 256 keys
    (2, 600, 128, 3, "tensor", True, 5, 1, 2),  # one key scale; a head dim of two tile slices
    (1, 100, 64, 2, "channel", True, 1, 7, 4),  # 2-bit values; an admission chunk (causal within it)
    (2, 257, 64, 4, "channel", False, 3, 1, 1),  # 4-bit values, not rotated
    (2, 90, 80, 3, "channel", True, 2, 2, 2),  # a head dim the tiles do not take (the vector path serves)
    (1, 40, 12, 3, "channel", True, 2, 1, 1),  # rows of codes that do not start on a byte: code by code
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[1]}-D{c[2]}-b{c[3]}-{c[4]}-rot{c[5]}-w{c[7]}" for c in CASES])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_over_the_stored_pool_equals_attention_over_it_decoded(built, case, dtype, atol):
    kv_heads, tokens, dim, bits, granularity, rotation, rows, width, groups = case
    gen = torch.Generator().manual_seed(tokens + dim)
    layer = _layer(gen, kv_heads=kv_heads, tokens=tokens, dim=dim, bits=bits, granularity=granularity,
                   rotation=rotation)  # fmt: skip
    stored, reference = _groups(gen, layer, rows=rows, width=width, groups=groups, suffix=20, dtype=dtype)
    expected = grouped_attention([reference], 0.125)  # float32 over the decoded pool: the kernel's own reference
    for tiles in (False, True):
        got = grouped_attention([stored], 0.125, tiles=tiles)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


def test_the_tile_path_equals_the_vector_path_within_bfloat16_rounding(built):
    if not tiles_available():
        pytest.skip("this CPU (or this build) has no AMX tiles: the vector path serves")
    gen = torch.Generator().manual_seed(3)
    layer = _layer(gen, kv_heads=3, tokens=1100, dim=64)
    for rows, width in [(1, 1), (15, 1), (2, 40)]:  # one agent, fifteen, admission chunks past one tile of queries
        stored, reference = _groups(gen, layer, rows=rows, width=width, groups=3, suffix=60, dtype=torch.bfloat16)
        decoded = KernelGroup(*(t.bfloat16() if t.is_floating_point() else t for t in (
            reference.query, reference.prefix_keys, reference.prefix_values, reference.suffix_keys,
            reference.suffix_values, reference.starts, reference.past)), reference.width)  # fmt: skip
        for group in (stored, decoded):
            vectors = grouped_attention([group], 0.125, tiles=False).float()
            tiles = grouped_attention([group], 0.125, tiles=True).float()
            torch.testing.assert_close(tiles, vectors, atol=2e-2, rtol=0)
            assert not torch.equal(tiles, vectors)  # the tiles did run: bfloat16 products, another rounding


def test_the_tiles_switch_keeps_the_vector_path_and_says_tiles_are_not_available(built, monkeypatch):
    if not tiles_available():
        pytest.skip("this CPU (or this build) has no AMX tiles: the vector path serves")
    gen = torch.Generator().manual_seed(5)
    stored, _ = _groups(gen, _layer(gen, kv_heads=3, tokens=400, dim=64), rows=4, width=1, groups=3, suffix=30,
                        dtype=torch.bfloat16)  # fmt: skip
    tiles, vectors = (grouped_attention([stored], 0.125, tiles=t) for t in (True, False))
    assert torch.equal(grouped_attention([stored], 0.125), tiles)  # on unless switched off
    monkeypatch.setenv("POLYKV_AGENTS_TILES", "0")
    assert torch.equal(grouped_attention([stored], 0.125), vectors) and not torch.equal(tiles, vectors)
    assert not tiles_available()  # so runtime="auto" keeps a decoded prefix


def test_a_stored_group_is_the_same_beside_decoded_groups(built):
    gen = torch.Generator().manual_seed(11)
    stored, reference = _groups(gen, _layer(gen, kv_heads=2, tokens=500, dim=64), rows=3, width=1, groups=2,
                                suffix=16, dtype=torch.bfloat16)  # fmt: skip
    other, _ = _groups(gen, _layer(gen, kv_heads=2, tokens=80, dim=64), rows=1, width=4, groups=2, suffix=16,
                       dtype=torch.bfloat16)  # fmt: skip
    decoded = KernelGroup(reference.query.bfloat16(), reference.prefix_keys.bfloat16(),
                          reference.prefix_values.bfloat16(), reference.suffix_keys.bfloat16(),
                          reference.suffix_values.bfloat16(), reference.starts, reference.past, 1)  # fmt: skip
    alone = grouped_attention([stored], 0.125)
    together = grouped_attention([decoded, stored, other], 0.125).split([3, 3, 4])
    assert torch.equal(together[1], alone)


def test_codecs_without_a_stored_form_are_decoded_instead():
    gen = torch.Generator().manual_seed(0)
    default = _layer(gen, kv_heads=1, tokens=8, dim=16)
    assert has_stored_form(default) and stored_layer(default) is not None
    four_bit_keys = EncodedLayer(IntLinearCodec(bits=4).encode(torch.randn(1, 1, 8, 16)), default.values)
    per_token = EncodedLayer(IntLinearCodec(bits=8, granularity="token").encode(torch.randn(1, 1, 8, 16)),
                             default.values)  # fmt: skip
    int_values = EncodedLayer(default.keys, IntLinearCodec(bits=8).encode(torch.randn(1, 1, 8, 16)))
    for layer in (four_bit_keys, per_token, int_values):
        assert not has_stored_form(layer) and stored_layer(layer) is None


def test_a_stored_layer_holds_views_of_the_pool_and_shares_its_codebook():
    gen = torch.Generator().manual_seed(0)
    first, second = (_layer(gen, kv_heads=2, tokens=30, dim=64) for _ in range(2))
    a, b = stored_layer(first), stored_layer(second)
    assert a.key_codes.data_ptr() == first.keys.tensors["codes"].data_ptr()
    assert a.value_codes.data_ptr() == first.values.tensors["codes"].data_ptr()
    assert a.value_norms.data_ptr() == first.values.tensors["norms"].data_ptr()
    assert a.centroids.data_ptr() == b.centroids.data_ptr() and a.rotation.data_ptr() == b.rotation.data_ptr()
    assert a.key_scale.shape == (2, 64) and a.rotation.shape == (64, 64)
