"""transformers' QuantizedCache (quanto) measured by the project's perplexity protocol, bytes from real tensors."""

from __future__ import annotations

import math

import optimum.quanto  # noqa: F401  (the dev extra installs it: these tests run, never skip)
import pytest
import torch

from benchmarks.studies import hf_quantized
from benchmarks.studies.hf_quantized import (
    prefill_quantized_cache,
    quantized_cache_nbytes,
    quantized_cache_perplexity,
)
from polykv_agents.config import CompressionConfig
from polykv_agents.eval.perplexity import perplexity_deltas
from polykv_agents.model.compat import forward_with_cache

CONTEXT, CONTINUATION, GROUP = 256, 64, 64
# tiny_llama: 2 layers, 2 KV heads, head_dim 16, fp32
LAYERS, KV_HEADS, HEAD_DIM, FP32 = 2, 2, 16, 4


def _expected_quantized_nbytes(tokens: int, bits: int) -> int:
    """Packed codes plus one fp32 scale and one fp32 shift per group of 64, for keys and values of every layer."""
    elements = tokens * KV_HEADS * HEAD_DIM
    groups = elements // GROUP
    return LAYERS * 2 * (elements * bits // 8 + 2 * groups * FP32)


@pytest.fixture(scope="module")
def results(tiny_model, tiny_tok, sample_document):
    return {
        bits: quantized_cache_perplexity(
            tiny_model,
            tiny_tok,
            sample_document,
            context_tokens=CONTEXT,
            continuation_tokens=CONTINUATION,
            nbits=bits,
        )
        for bits in (4, 2)
    }


def test_quantized_bytes_are_below_fp16_and_shrink_with_bits(results):
    four, two = results[4], results[2]
    assert four["fp16_kv_bytes"] == LAYERS * 2 * CONTEXT * KV_HEADS * HEAD_DIM * 2
    assert four["kv_bytes"] < four["fp16_kv_bytes"]
    assert two["kv_bytes"] < four["kv_bytes"]
    assert {r["backend"] for r in results.values()} == {"quanto"}
    assert [r["nbits"] for r in results.values()] == [4, 2]
    assert {r["context_tokens"] for r in results.values()} == {CONTEXT}


def test_bytes_count_codes_scales_and_shifts(results):
    for bits, result in results.items():
        assert result["kv_bytes"] == _expected_quantized_nbytes(CONTEXT, bits)


def test_ppl_full_is_the_projects_full_precision_perplexity(results, tiny_model, tiny_tok, sample_document):
    (reference,) = perplexity_deltas(
        tiny_model,
        tiny_tok,
        sample_document,
        context_tokens=CONTEXT,
        continuation_tokens=CONTINUATION,
        configs=[CompressionConfig.full_precision()],
    )
    for result in results.values():
        assert result["ppl_full"] == pytest.approx(reference.ppl_full, rel=1e-4)


def test_delta_is_finite_and_the_cache_really_was_quantized(results):
    for result in results.values():
        assert math.isfinite(result["ppl_quantized"])
        assert math.isfinite(result["delta_pct"])
        assert result["ppl_quantized"] != result["ppl_full"]
        expected = 100.0 * (result["ppl_quantized"] - result["ppl_full"]) / result["ppl_full"]
        assert result["delta_pct"] == pytest.approx(expected)


def test_prefill_quantizes_the_whole_prefix_and_the_residual_is_counted(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(3, 320, (CONTEXT + 10,))
    cache = prefill_quantized_cache(tiny_model, ids[:CONTEXT], nbits=4)
    for layer in cache.layers:
        assert layer._quantized_keys.shape[-2] == CONTEXT
        assert layer.keys.numel() == 0 and layer.values.numel() == 0
    before = quantized_cache_nbytes(cache)
    assert before == _expected_quantized_nbytes(CONTEXT, 4)
    # 10 more tokens (< residual_length) stay in the full-precision residual, and their bytes count.
    with torch.inference_mode():
        forward_with_cache(tiny_model, ids[CONTEXT:].unsqueeze(0), cache, start_position=CONTEXT)
    assert cache.layers[0].keys.shape[-2] == 10
    assert quantized_cache_nbytes(cache) - before == LAYERS * 2 * 10 * KV_HEADS * HEAD_DIM * FP32


def test_a_missing_backend_names_the_extra(monkeypatch, tiny_model):
    monkeypatch.setitem(hf_quantized.BACKEND_MODULES, "quanto", "no_such_quantization_backend")
    with pytest.raises(ImportError, match=r"polykv-agents\[peers\]"):
        prefill_quantized_cache(tiny_model, torch.arange(3, 10), nbits=4)
