"""The transformers-version shim: both cache keyword spellings reach the model."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama
from transformers import LlamaForCausalLM

from polykv_agents.model.compat import cache_keyword, forward_with_cache, layer_key_values, new_dynamic_cache


class LegacyKeywordLlama(LlamaForCausalLM):
    """A model whose forward still spells the cache `past_key_values` (transformers < 5.24, remote code)."""

    def forward(self, input_ids=None, position_ids=None, past_key_values=None, use_cache=None, **kwargs):
        assert "cache" not in kwargs, "the new keyword must not be sent to a legacy forward"
        return super().forward(
            input_ids=input_ids, position_ids=position_ids, cache=past_key_values, use_cache=use_cache, **kwargs
        )


def test_current_models_take_the_cache_keyword():
    assert cache_keyword(tiny_llama()) == "cache"


def test_legacy_forward_gets_past_key_values_and_the_same_result():
    model = tiny_llama()
    legacy = LegacyKeywordLlama(model.config).eval()
    legacy.load_state_dict(model.state_dict())
    assert cache_keyword(legacy) == "past_key_values"
    ids = torch.arange(5, 25).unsqueeze(0)
    logits = {}
    for m in (model, legacy):
        cache = new_dynamic_cache(m)
        with torch.inference_mode():
            forward_with_cache(m, ids[:, :12], cache, start_position=0)
            logits[m] = forward_with_cache(m, ids[:, 12:], cache, start_position=12)
        assert layer_key_values(cache)[0][0].shape[-2] == 20  # the legacy model filled the same cache
    torch.testing.assert_close(logits[model], logits[legacy])
