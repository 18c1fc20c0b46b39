"""The naive batched baseline decodes what the runtime decodes, over a static cache sized once."""

from __future__ import annotations

import pytest

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.naive import naive_batched_decode
from polykv_agents.config import CompressionConfig
from polykv_agents.engine import Engine
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.sampling.settings import GenerationSettings
from tests.tiny_models import assert_pairwise_distinct, tiny_causal_lm, tiny_sensitive_llama


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_naive_batched_decodes_the_runtimes_greedy_tokens_for_every_row(family, tiny_tok, sample_document):
    model = tiny_sensitive_llama() if family == "llama" else tiny_causal_lm(family)
    pool = SharedKVPool.prefill(model, tiny_tok, sample_document[:600], config=CompressionConfig.full_precision())
    engine = Engine(scheduler_idle_seconds=None)
    try:
        agents = [PooledAgent(pool, model, tiny_tok, system_prompt="Role " + "x " * i, engine=engine) for i in range(3)]
        questions = ["first question", "a second, longer question about it", "third"]
        settings = GenerationSettings(max_new_tokens=6, ignore_eos=True)
        expected = [list(a.generate_ids(q, settings)) for a, q in zip(agents, questions, strict=True)]
        prompts = [a.prompt_ids(q) for a, q in zip(agents, questions, strict=True)]
    finally:
        engine.close()
    assert len({p.numel() for p in prompts}) == 3  # rows are left-padded differently
    run = naive_batched_decode(model, pool, prompts, max_new_tokens=6)
    assert run.token_ids.tolist() == expected
    if family == "llama":  # the sensitive model answers each row differently, so a row mix-up shows
        assert_pairwise_distinct(expected)
    # The static cache holds N copies of prefix + longest prompt + new tokens, allocated once.
    prefix_bytes = sum(k.nbytes + v.nbytes for k, v in map(pool.decompress_layer, range(pool.num_layers)))
    slots = pool.num_tokens + max(p.numel() for p in prompts) + 6
    assert run.kv_bytes * pool.num_tokens == 3 * prefix_bytes * slots
    assert run.seconds > 0
