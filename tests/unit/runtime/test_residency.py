"""runtime="auto": the pool kept only as stored where the kernel reads it through AMX tiles, the decoded prefix
elsewhere; and a bfloat16 model answers the same either way."""

from __future__ import annotations

import pytest
import torch
from native_kernels import require_native_kernel
from tiny_models import tiny_llama

from polykv_agents import Engine, PooledAgent, SharedKVPool
from polykv_agents.config import CompressionConfig
from polykv_agents.runtime import residency
from polykv_agents.runtime.residency import auto_residency, reads_stored_pool_fast
from polykv_agents.sampling.settings import GenerationSettings

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 4


@pytest.fixture(scope="module")
def bf16_model():
    """A model the tiles can serve: bfloat16, head dim 64."""
    return tiny_llama(head_dim=64, initializer_range=0.3).to(torch.bfloat16)  # distinct logits: no near-ties


@pytest.fixture(scope="module")
def bf16_pool(bf16_model, tiny_tok):
    return SharedKVPool.prefill(bf16_model, tiny_tok, DOC)


def test_with_tiles_a_bfloat16_model_keeps_only_the_pool(bf16_model, bf16_pool, monkeypatch):
    monkeypatch.setattr(residency, "tiles_available", lambda: True)
    assert reads_stored_pool_fast(bf16_model, bf16_pool)
    assert auto_residency(bf16_model, bf16_pool, compiled_steps=False) == "compressed"
    # Compiled decode steps exist for the decoded prefix only.
    assert auto_residency(bf16_model, bf16_pool, compiled_steps=True) == "decompressed"


def test_without_tiles_or_in_float32_the_prefix_is_kept_decoded(bf16_model, bf16_pool, tiny_model, tiny_tok,
                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setattr(residency, "tiles_available", lambda: False)
    assert auto_residency(bf16_model, bf16_pool, compiled_steps=False) == "decompressed"
    monkeypatch.setattr(residency, "tiles_available", lambda: True)
    fp32_pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    assert auto_residency(tiny_model, fp32_pool, compiled_steps=False) == "decompressed"  # float32: no tiles
    narrow = tiny_llama(head_dim=16).to(torch.bfloat16)  # a head dim the tiles do not cover
    assert auto_residency(narrow, SharedKVPool.prefill(narrow, tiny_tok, DOC), compiled_steps=False) == "decompressed"


def test_codecs_without_a_stored_form_keep_the_prefix_decoded(bf16_model, tiny_tok, monkeypatch):
    monkeypatch.setattr(residency, "tiles_available", lambda: True)
    pool = SharedKVPool.prefill(bf16_model, tiny_tok, DOC, config=CompressionConfig.max_compression())
    assert not reads_stored_pool_fast(bf16_model, pool)
    assert auto_residency(bf16_model, pool, compiled_steps=False) == "decompressed"


def test_the_auto_runtime_serves_each_call_from_the_residency_it_picks(bf16_model, bf16_pool, tiny_tok, monkeypatch):
    require_native_kernel("grouped_attention")
    answers = {}
    for tiles in (True, False):
        monkeypatch.setattr(residency, "tiles_available", lambda tiles=tiles: tiles)
        engine = Engine(scheduler_idle_seconds=None)
        try:
            agent = PooledAgent(bf16_pool, bf16_model, tiny_tok, system_prompt="Be brief.", engine=engine)
            assert agent.runtime == "auto"
            settings = GenerationSettings(max_new_tokens=6, ignore_eos=True)
            answers[tiles] = list(agent.generate_ids("What is quantised?", settings))
            live = [key[1] for key, _ in engine.schedulers._keyed()]
            assert live == ["compressed" if tiles else "decompressed"]
        finally:
            engine.close()
    assert answers[True] == answers[False]  # the same greedy tokens over the stored pool and the decoded prefix
