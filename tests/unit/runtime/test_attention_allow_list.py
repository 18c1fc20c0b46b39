"""The batched runtime serves only attention it implements: anything else is refused or sent to the private
runtime, never computed wrongly."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import FAMILIES, tiny_causal_lm, tiny_tokenizer
from transformers import AutoModelForCausalLM, GptOssConfig

from polykv_agents import CompressionConfig, Engine, GenerationSettings, PooledAgent, SharedKVPool
from polykv_agents.model.architecture import unsupported_batched_attention
from polykv_agents.runtime.cascade_attention import UnsupportedAttentionError, check_attention_kwargs
from polykv_agents.runtime.request import DecodeRequest

DOC = "Keys are quantised to eight bits; values use a rotated codebook. " * 3
SETTINGS = GenerationSettings(max_new_tokens=12, ignore_eos=True)


def tiny_gpt_oss() -> torch.nn.Module:
    """GPT-OSS: attention sinks (a learned per-head logit in every softmax), which cascade attention lacks.
    The sinks are made large so that ignoring them would change the answer."""
    config = GptOssConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        sliding_window=256,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.normal_(0, 2)
    return model


@pytest.fixture(scope="module")
def sinks_model():
    return tiny_gpt_oss()


@pytest.fixture(scope="module")
def sinks_pool(sinks_model):
    return SharedKVPool.prefill(sinks_model, tiny_tokenizer(), DOC, config=CompressionConfig.full_precision())


def plain_greedy(model, ids: torch.Tensor) -> list[int]:
    mask = torch.ones(1, ids.numel(), dtype=torch.long)
    out = model.generate(ids.unsqueeze(0), attention_mask=mask, max_new_tokens=SETTINGS.max_new_tokens, do_sample=False)
    return out[0, ids.numel() :].tolist()


def test_a_model_with_attention_sinks_is_served_by_the_private_runtime_and_stays_exact(sinks_model, sinks_pool, caplog):
    engine = Engine()
    tok = tiny_tokenizer()
    agent = PooledAgent(sinks_pool, sinks_model, tok, engine=engine)  # the batched runtime by default
    with caplog.at_level(logging.WARNING, logger="polykv_agents.runtime.backend"):
        first = list(agent.generate_ids("What is it?", SETTINGS))
        second = list(agent.generate_ids("What is it?", SETTINGS))
    ids = torch.cat([sinks_pool.token_ids, agent.prompt_ids("What is it?")])
    assert first == second == plain_greedy(sinks_model, ids)
    assert len(engine.schedulers) == 0  # no batch scheduler was started for it
    warnings = [r.getMessage() for r in caplog.records if "attention sinks" in r.getMessage()]
    reason = unsupported_batched_attention(sinks_model)
    # said once per model, not per call, with what happens to its calls
    assert warnings == [f"{reason}; its calls run on the private runtime (one decoded pool per call)"]


def test_the_cascade_kernel_itself_refuses_an_attention_feature_it_lacks(sinks_model, sinks_pool):
    """Defence in depth: a request forced onto a scheduler fails loudly instead of ignoring the sinks."""
    engine = Engine()
    tok = tiny_tokenizer()
    prompt = PooledAgent(sinks_pool, sinks_model, tok, engine=engine).prompt_ids("What is it?")
    scheduler = engine.schedulers.scheduler_for(sinks_model, tok, sinks_pool, "decompressed")
    with pytest.raises(UnsupportedAttentionError, match="s_aux"):
        list(scheduler.submit(DecodeRequest(sinks_model, tok, prompt, SETTINGS, pool=sinks_pool), 4))
    engine.close()


def test_check_attention_kwargs_allows_the_implemented_features_and_nothing_else():
    check_attention_kwargs({"sliding_window": 64, "softcap": 50.0, "position_ids": torch.zeros(1), "s_aux": None})
    with pytest.raises(UnsupportedAttentionError, match=r"\['alibi_slopes'\].*runtime='private'"):
        check_attention_kwargs({"sliding_window": None, "alibi_slopes": torch.zeros(4)})


@pytest.mark.parametrize("family", FAMILIES)
def test_every_supported_family_is_served_batched(family):
    assert unsupported_batched_attention(tiny_causal_lm(family)) is None


@pytest.mark.parametrize(
    ("setting", "reason"),
    [("alibi", "ALiBi"), ("attention_chunk_size", "chunked"), ("use_bidirectional_attention", "bidirectional")],
)
def test_config_flags_of_unsupported_attention_are_named(setting, reason):
    model = tiny_causal_lm("llama")
    value = 8 if setting == "attention_chunk_size" else True
    setattr(model.config, setting, value)
    try:
        assert reason in unsupported_batched_attention(model)
    finally:
        delattr(model.config, setting)
