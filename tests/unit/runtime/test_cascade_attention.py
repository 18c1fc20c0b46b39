"""Cascade attention equals ordinary attention over [prefix, suffix], for prefill and batched decode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from native_kernels import require_native_kernel
from tiny_models import tiny_sensitive_llama

from polykv_agents import SharedKVPool
from polykv_agents.model.compat import forward_with_cache
from polykv_agents.runtime import cascade_attention
from polykv_agents.runtime.cascade_attention import ATTENTION_NAME, CascadeContext, enable_cascade_attention
from polykv_agents.runtime.shared_prefix import SharedPrefix
from polykv_agents.runtime.suffix_cache import SuffixCache

DOC = "The quick brown fox jumps over the lazy dog. " * 10


@pytest.fixture(params=["native", "fused", "unfused"])
def kernel(request, monkeypatch):
    """Run a test through the native grouped kernel, PyTorch's fused CPU kernel and the portable matmul path."""
    if request.param == "native":
        require_native_kernel("grouped_attention")
        return request.param
    monkeypatch.setenv("POLYKV_AGENTS_KERNELS", "0")
    if request.param == "unfused":
        monkeypatch.setattr(cascade_attention, "_CPU_FLASH", None)
    elif cascade_attention._CPU_FLASH is None:
        pytest.skip("this PyTorch has no fused CPU attention kernel")
    return request.param


@pytest.fixture(scope="module")
def setup(tiny_tok):
    model = tiny_sensitive_llama(seed=3)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    reference = tiny_sensitive_llama(seed=3)  # same weights, left on SDPA
    enable_cascade_attention(model)
    return model, reference, pool


def _reference_logits(reference, pool, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return forward_with_cache(
            reference, ids.unsqueeze(0), pool.to_cache(reference), start_position=pool.num_tokens
        )[0]


def _cascade(model, prefix, cache: SuffixCache, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, q] -> logits [B, q, vocab] through the cascade path (left padding clamped to valid positions)."""
    slots = (cache.lengths - cache.starts).view(-1, 1) + torch.arange(ids.shape[-1])
    with torch.inference_mode():
        logits = model(
            input_ids=ids,
            position_ids=(prefix.num_tokens + slots).clamp(min=0),
            cache=cache,
            use_cache=True,
            cascade=CascadeContext(prefix, cache.lengths.clone(), cache.starts.clone()),
        ).logits
    cache.advance(ids.shape[-1])
    return logits


@pytest.mark.parametrize("residency", ["decompressed", "compressed"])
def test_prefill_and_batched_decode_match_ordinary_attention(setup, residency, kernel):
    model, reference, pool = setup
    prefix = SharedPrefix(pool, model, residency)
    # Over the pool as stored, the kernel folds the key scale into the queries: the same sums in another order.
    atol = 5e-5 if residency == "compressed" and kernel == "native" else 1e-5
    suffixes = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 2)]
    batch = SuffixCache(model.config.num_hidden_layers, 0)
    for suffix in suffixes:  # each agent joins with its own prompt length
        row = SuffixCache(model.config.num_hidden_layers, 1)
        logits = _cascade(model, prefix, row, suffix.view(1, -1))[0]
        torch.testing.assert_close(logits, _reference_logits(reference, pool, suffix), rtol=1e-4, atol=atol)
        batch.concat(row)
    next_tokens = torch.tensor([[7], [8], [9]])
    for step in range(3):  # a few batched steps: rows have different suffix lengths throughout
        logits = _cascade(model, prefix, batch, next_tokens)[:, -1]
        for row, suffix in enumerate(suffixes):
            history = torch.cat([suffix, next_tokens[row].repeat(step + 1)])
            expected = _reference_logits(reference, pool, history)[-1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=atol)


def test_calls_without_a_cascade_context_are_plain_sdpa(setup):
    model, reference, _ = setup
    assert model.config._attn_implementation == ATTENTION_NAME
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_compressed_residency_holds_no_decoded_prefix(setup):
    model, _, pool = setup
    compressed = SharedPrefix(pool, model, "compressed")
    assert compressed.layers() == () and compressed.stored(0) is not None  # the pool's own tensors, as stored
    # Besides the pool: each layer's key scale as float32, and one codebook and one rotation shared by all layers.
    stored = [compressed.stored(i) for i in range(pool.num_layers)]
    scales = sum(layer.key_scale.nbytes for layer in stored)
    assert compressed.resident_nbytes == scales + stored[0].centroids.nbytes + stored[0].rotation.nbytes
    assert stored[0].key_codes.data_ptr() == pool.layers[0].keys.tensors["codes"].data_ptr()  # a view, no copy
    decompressed = SharedPrefix(pool, model, "decompressed")
    assert decompressed.resident_nbytes == pool.model_dtype_nbytes  # decoded once, in the model's dtype
    with pytest.raises(ValueError, match="residency"):
        SharedPrefix(pool, model, "gpu")


def test_left_padded_rows_prefilled_together_match_ordinary_attention(setup, kernel):
    """Batched admission: prompts of different lengths, left-padded into one forward, then decoded."""
    model, reference, pool = setup
    prefix = SharedPrefix(pool, model)
    prompts = [torch.tensor([5, 6, 7, 8, 9, 10, 11]), torch.tensor([20, 21])]
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    cache = SuffixCache(model.config.num_hidden_layers, len(prompts))
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt
        cache.starts[row] = width - prompt.numel()
    logits = _cascade(model, prefix, cache, ids)
    assert torch.isfinite(logits).all()
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(
            logits[row, -1], _reference_logits(reference, pool, prompt)[-1], rtol=1e-4, atol=1e-5
        )
    step = _cascade(model, prefix, cache, torch.tensor([[3], [4]]))
    for row, prompt in enumerate(prompts):
        expected = _reference_logits(reference, pool, torch.cat([prompt, torch.tensor([3 + row])]))[-1]
        torch.testing.assert_close(step[row, -1], expected, rtol=1e-4, atol=1e-5)


def test_fused_and_unfused_kernels_agree_and_mark_fully_masked_rows():
    if cascade_attention._CPU_FLASH is None:
        pytest.skip("this PyTorch has no fused CPU attention kernel")
    gen = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(2, 3, n, 8, generator=gen) for n in (4, 6, 6))
    visible = torch.rand(2, 1, 4, 6, generator=gen) > 0.4
    visible[..., 0] = True
    visible[1, :, 2] = False  # a left-padding query: sees nothing
    visible[0, :, 1, :3], visible[0, :, 1, 3] = False, True  # a query that sees keys of the second half only
    additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    fused = cascade_attention._attend(query, keys, values, 0.3, bool_mask=visible, additive_mask=additive)
    unfused = cascade_attention._attend_unfused(query, keys, values, 0.3, visible)
    reduced = cascade_attention._attend(query, keys, values, 0.3, bool_mask=visible, reduced=True)
    halves = cascade_attention._attend_reduced_in_halves(query, keys, values, 0.3, visible)
    seen = visible.expand(2, 3, 4, 6).any(-1)  # [N, H, n]
    paths = ((fused, "fused"), (unfused, "unfused"), (reduced, "reduced"), (halves, "reduced in halves"))
    for (out, lse), name in paths:
        assert torch.isfinite(out).all(), name
        # A query that sees nothing must weigh nothing in the merge: its log-sum-exp is -inf, on every path.
        assert torch.isneginf(lse[~seen]).all(), name
        assert torch.isfinite(lse[seen]).all(), name
    for other in (fused, reduced, halves):
        for got, expected in zip(other, unfused, strict=True):
            torch.testing.assert_close(got[seen], expected[seen], rtol=1e-5, atol=1e-6)


def test_the_compiled_prefix_attention_serves_documents_on_both_sides_of_4096_tokens_with_one_graph():
    """Inductor guards a float32 sum over more than 4,096 elements (it then sums in cascades): summed over the
    whole prefix, the first document past 4,096 tokens would compile every graph again. In halves, one graph
    serves every document up to 8,192 tokens, and stays exact."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    attend = torch.compile(cascade_attention._attend_reduced_in_halves, backend=counter, dynamic=False)
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(1, 2, 3, 16, generator=gen)
    for tokens in (1000, 5000, 8000):
        keys, values = (torch.randn(1, 2, tokens, 16, generator=gen) for _ in "kv")
        torch._dynamo.mark_dynamic(keys, 2)
        torch._dynamo.mark_dynamic(values, 2)
        for got, expected in zip(attend(query, keys, values, 0.25), cascade_attention._attend_unfused(
            query, keys, values, 0.25), strict=True):  # fmt: skip
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1


def test_reduced_attention_soft_caps_like_the_unfused_one():
    """Gemma 2's soft-capping, which compiled decode steps run through the reduced formulation."""
    gen = torch.Generator().manual_seed(1)
    query, keys, values = (torch.randn(1, 2, n, 8, generator=gen) * 4 for n in (3, 9, 9))
    capped = cascade_attention._attend_reduced(query, keys, values, 1.0, softcap=2.0)
    unfused = cascade_attention._attend_unfused(query, keys, values, 1.0, softcap=2.0)
    in_halves = cascade_attention._attend_reduced_in_halves(query, keys, values, 1.0, softcap=2.0)
    for got, expected in [*zip(capped, unfused, strict=True), *zip(in_halves, unfused, strict=True)]:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    uncapped = cascade_attention._attend_reduced(query, keys, values, 1.0)
    assert not torch.allclose(capped[1], uncapped[1])  # the cap changed the scores


class _Prefix:
    """What cascade attention reads from a SharedPrefix kept decoded."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values, self.num_tokens = keys, values, keys.shape[-2]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def stored(self, layer_idx: int) -> None:
        return None  # no stored form: the keys and values above are the prefix


def _eager_reference(query, prefix_keys, prefix_values, keys, values, past, starts, scaling, window, softcap):
    """Row by row: softmax over [prefix, the row's own suffix] with transformers' causal, sliding-window
    and soft-capping semantics (a key is visible iff ``0 <= q_pos - k_pos < window``)."""
    batch, heads, q_len, _ = query.shape
    groups = heads // prefix_keys.shape[1]
    total = prefix_keys.shape[-2]
    outs = []
    for r in range(batch):
        suffix = slice(int(starts[r]), int(past[r]) + q_len)
        k = torch.cat([prefix_keys[0], keys[r, :, suffix]], dim=1).repeat_interleave(groups, 0)  # [H, K, D]
        v = torch.cat([prefix_values[0], values[r, :, suffix]], dim=1).repeat_interleave(groups, 0)
        k_pos = torch.arange(k.shape[1])
        q_pos = total + int(past[r] - starts[r]) + torch.arange(q_len)
        distance = q_pos.view(-1, 1) - k_pos.view(1, -1)  # [q, K]
        visible = (distance >= 0) & (distance < (window or 10**9))
        scores = query[r] @ k.transpose(-1, -2) * scaling  # [H, q, K]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append((weights @ v).transpose(0, 1))  # [q, H, D]
    return torch.stack(outs)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "sliding"])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_sliding_window_and_soft_capping_match_eager_semantics(kernel, window, softcap):
    """Scores large enough that capping matters, queries far enough past the prefix that the window
    hides all of it for some rows: the prefix part of those rows must then weigh nothing."""
    gen = torch.Generator().manual_seed(1)
    batch, kv_heads, groups, dim, total, q_len = 3, 2, 2, 8, 5, 2
    past, starts = torch.tensor([9, 3, 0]), torch.tensor([0, 2, 0])
    suffix_len = int(past.max()) + q_len
    query = torch.randn(batch, kv_heads * groups, q_len, dim, generator=gen) * 3
    prefix_keys, prefix_values = (torch.randn(1, kv_heads, total, dim, generator=gen) * 3 for _ in range(2))
    keys, values = (torch.randn(batch, kv_heads, suffix_len, dim, generator=gen) * 3 for _ in range(2))
    context = CascadeContext(_Prefix(prefix_keys, prefix_values), past, starts)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    out, _ = cascade_attention.cascade_attention_forward(
        layer, query, keys, values, None, scaling=0.5, cascade=context, sliding_window=window, softcap=softcap
    )
    expected = _eager_reference(query, prefix_keys, prefix_values, keys, values, past, starts, 0.5, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def _context(prefix_tokens: int, past_lengths: list[int], starts: list[int] | None = None) -> CascadeContext:
    """A context over a prefix of ``prefix_tokens`` tokens; the masks read only its length."""
    prefix = SimpleNamespace(num_tokens=prefix_tokens)
    return CascadeContext(prefix, torch.tensor(past_lengths), None if starts is None else torch.tensor(starts))


def test_starts_default_to_no_left_padding():
    context = _context(4, [2, 0])
    assert context.starts.tolist() == [0, 0]
    assert context.query_positions(1).tolist() == [[6], [4]]


def test_a_query_exactly_one_window_past_the_first_prefix_token_no_longer_sees_it():
    """Position p sees tokens > p - window: at p == window, token 0 drops out (as transformers' masks do)."""
    window = 4
    context = _context(4, [0])  # one query at position 4 == window
    mask = context.prefix_mask(q_len=1, groups=1, device=torch.device("cpu"), window=window)
    assert mask is not None and mask.view(-1).tolist() == [False, True, True, True]
    assert _context(4, [0]).prefix_mask(1, 1, torch.device("cpu"), window=5) is None  # still sees them all


def test_masks_of_full_and_sliding_layers_in_one_forward_are_kept_apart():
    """Alternating layer types (Gemma 2) ask one context for both masks: each must get its own."""
    context = _context(2, [6])
    device = torch.device("cpu")
    full = context.suffix_mask(8, 1, 1, device, window=None)
    sliding = context.suffix_mask(8, 1, 1, device, window=3)
    assert full.view(-1).tolist() == [True] * 7 + [False]
    assert sliding.view(-1).tolist() == [False] * 4 + [True] * 3 + [False]
    assert context.suffix_mask(8, 1, 1, device, window=None) is full  # built once per forward


def test_the_additive_mask_has_the_models_dtype():
    context = _context(2, [1])
    mask = context.suffix_mask(4, 1, 1, torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        additive = context.additive(mask, dtype)
        assert additive.dtype == dtype
        assert additive.view(-1).tolist() == [0.0, 0.0, -torch.inf, -torch.inf]
