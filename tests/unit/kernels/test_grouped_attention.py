"""The native grouped cascade attention kernel equals attention over each row's [prefix, visible suffix], group by
group, and a group's result does not depend on what else shares the call."""

from __future__ import annotations

import logging

import pytest
import torch
from native_kernels import require_native_kernel

from polykv_agents import kernels
from polykv_agents.runtime.grouped_attention import KERNEL_MAX_QUERIES, KernelGroup, grouped_attention, kernel_takes


@pytest.fixture
def built():
    """The kernel, built (once per machine; CI must be able to build it, elsewhere a missing compiler skips)."""
    require_native_kernel("grouped_attention")


def _group(gen, *, rows, width, prefix, suffix, kv_heads, groups, dim, dtype, starts=None, past=None):
    heads = kv_heads * groups

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    past = past if past is not None else torch.randint(0, suffix - width + 1, (rows,), generator=gen)
    starts = starts if starts is not None else torch.minimum(torch.randint(0, 3, (rows,), generator=gen), past)
    # Suffix tensors are views into wider buffers, as a SuffixCache's are.
    suffix_keys = rand(rows, kv_heads, suffix + 5, dim)[:, :, :suffix]
    suffix_values = rand(rows, kv_heads, suffix + 5, dim)[:, :, :suffix]
    query = rand(1, rows * width, heads, dim).transpose(1, 2)[0]  # [H, N, D] with a model's strides
    return KernelGroup(query, rand(1, kv_heads, prefix, dim), rand(1, kv_heads, prefix, dim), suffix_keys,
                       suffix_values, starts, past, width)  # fmt: skip


def _reference(group: KernelGroup, scaling: float) -> torch.Tensor:
    """[rows*width, H, D] float32: each query over the prefix and the suffix slots it sees, by plain softmax."""
    heads, _, dim = group.query.shape
    kv_heads = group.prefix_keys.shape[1]
    rows = group.suffix_keys.shape[0]
    outs = []
    for r in range(rows):
        for i in range(group.width):
            seen = slice(int(group.starts[r]), int(group.past[r]) + i + 1)
            keys = torch.cat([group.prefix_keys[0], group.suffix_keys[r, :, seen]], dim=1).float()
            values = torch.cat([group.prefix_values[0], group.suffix_values[r, :, seen]], dim=1).float()
            query = group.query[:, r * group.width + i].float().view(kv_heads, heads // kv_heads, dim)
            if keys.shape[1] == 0:
                outs.append(torch.zeros(heads, dim))
                continue
            weights = (torch.einsum("hgd,hkd->hgk", query, keys) * scaling).softmax(-1)
            outs.append(torch.einsum("hgk,hkd->hgd", weights, values).reshape(heads, dim))
    return torch.stack(outs)


SHAPES = [
    # rows, width, prefix, suffix, kv heads, query heads per kv head, head dim
    (2, 1, 300, 40, 3, 3, 64),  # decode rows; prefix past one chunk of 256
    (1, 7, 100, 50, 2, 2, 64),  # an admission chunk: causal within the chunk
    (4, 1, 512, 9, 1, 1, 16),  # exactly two chunks; a head dim below one register slice
    (3, 2, 257, 20, 2, 4, 80),  # one key into a second chunk; a head dim that leaves a tail
    (2, 1, 0, 12, 3, 3, 64),  # no prefix at all
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"rows{s[0]}-w{s[1]}-T{s[2]}-D{s[6]}" for s in SHAPES])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_each_query_gets_softmax_attention_over_its_prefix_and_the_suffix_it_sees(built, shape, dtype, atol):
    rows, width, prefix, suffix, kv_heads, groups, dim = shape
    gen = torch.Generator().manual_seed(sum(shape))
    group = _group(gen, rows=rows, width=width, prefix=prefix, suffix=suffix, kv_heads=kv_heads, groups=groups,
                   dim=dim, dtype=dtype)  # fmt: skip
    got = grouped_attention([group], 0.125)
    assert got.dtype == dtype and got.shape == (rows * width, kv_heads * groups, dim)
    torch.testing.assert_close(got.float(), _reference(group, 0.125), atol=atol, rtol=0)


def test_left_padding_is_never_seen_and_a_query_that_sees_nothing_gets_zero(built):
    gen = torch.Generator().manual_seed(0)
    # Row 0 starts at slot 6 and had 3 filled before: its first three chunk tokens see no suffix slot, and
    # with no prefix they see nothing at all.
    group = _group(gen, rows=2, width=5, prefix=0, suffix=12, kv_heads=2, groups=2, dim=32, dtype=torch.float32,
                   starts=torch.tensor([6, 0]), past=torch.tensor([3, 4]))  # fmt: skip
    got = grouped_attention([group], 0.2)
    torch.testing.assert_close(got, _reference(group, 0.2), atol=2e-5, rtol=0)
    assert got[:3].abs().sum() == 0 and got[3].abs().sum() > 0
    # The padding's keys do not leak in: changing them changes nothing.
    group.suffix_keys[0, :, :6] += 100.0
    torch.testing.assert_close(grouped_attention([group], 0.2), got, atol=0, rtol=0)


def test_a_groups_result_is_the_same_alone_beside_others_and_on_one_thread(built):
    gen = torch.Generator().manual_seed(5)
    groups = [
        _group(
            gen, rows=rows, width=width, prefix=prefix, suffix=30, kv_heads=3, groups=3, dim=64, dtype=torch.bfloat16
        )
        for rows, width, prefix in [(2, 1, 700), (1, 1, 90), (1, 6, 400), (3, 1, 1030)]
    ]
    together = grouped_attention(groups, 0.125).split([g.query.shape[1] for g in groups])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = grouped_attention(groups, 0.125).split([g.query.shape[1] for g in groups])
    finally:
        torch.set_num_threads(threads)
    for group, beside, single in zip(groups, together, one_thread, strict=True):
        alone = grouped_attention([group], 0.125)
        assert torch.equal(alone, beside) and torch.equal(alone, single)


def test_the_kernel_takes_only_what_it_implements(built):
    query, keys = torch.zeros(9, 2, 64), torch.zeros(2, 3, 4, 64)
    assert kernel_takes(query, keys, KERNEL_MAX_QUERIES, {})
    assert not kernel_takes(query, keys, KERNEL_MAX_QUERIES + 1, {})  # long query blocks: the fused kernel
    # Over a prefix kept as the pool stores it, at any count: the fused kernel would need the layer decoded first.
    assert kernel_takes(query, keys, 50 * KERNEL_MAX_QUERIES, {}, stored=True)
    assert not kernel_takes(query, keys, 6, {"sliding_window": 4}, stored=True)
    assert not kernel_takes(query, keys, 6, {"sliding_window": 4})
    assert not kernel_takes(query, keys, 6, {"softcap": 30.0})
    assert not kernel_takes(query.double(), keys.double(), 6, {})
    assert not kernel_takes(query, keys.half(), 6, {})
    assert not kernel_takes(query.requires_grad_(), keys, 6, {})


def test_switched_off_it_is_never_built_or_used(monkeypatch):
    monkeypatch.setenv(kernels.SWITCH, "0")
    assert kernels.native_kernel("grouped_attention") is None
    assert not kernel_takes(torch.zeros(9, 2, 64), torch.zeros(2, 3, 4, 64), 6, {})


def test_a_kernel_that_cannot_build_says_so_once_and_the_pytorch_path_serves(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    calls = []

    def failing_load(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.native_kernel("grouped_attention") is None
        assert kernels.native_kernel("grouped_attention") is None
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "native kernel 'grouped_attention' failed to build (g++: not found); using the PyTorch path"
    ]


def test_a_build_is_announced_while_it_runs_and_a_cached_load_says_nothing(monkeypatch, caplog):
    import time

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(kernels, "BUILD_NOTICE_SECONDS", 0.05)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: "cached")
        monkeypatch.setattr(kernels, "_loaded", {})
        assert kernels.native_kernel("grouped_attention") == "cached"
        time.sleep(0.1)  # a notice that was not cancelled would fire now
        assert caplog.records == []

        def slow_build(*args, **kwargs):
            time.sleep(0.3)
            return "built"

        monkeypatch.setattr(cpp_extension, "load", slow_build)
        monkeypatch.setattr(kernels, "_loaded", {})
        assert kernels.native_kernel("grouped_attention") == "built"
    assert [r.getMessage() for r in caplog.records] == [
        "building the native kernel 'grouped_attention' once (about 30 s on 2 cores; cached for later runs)"
    ]
