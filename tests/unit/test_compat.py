"""The transformers-version shim: both cache keyword spellings reach the model."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama
from transformers import LlamaForCausalLM

from polykv_agents.model.compat import (
    ReservedLayer,
    cache_keyword,
    forward_with_cache,
    layer_key_values,
    new_dynamic_cache,
    new_full_cache,
)


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


def _chunked(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Logits of ``ids [1, T]`` run on ``cache`` ``chunk`` tokens at a time: ``[1, T, vocab]``."""
    with torch.inference_mode():
        steps = range(0, ids.shape[1], chunk)
        return torch.cat([forward_with_cache(model, ids[:, s : s + chunk], cache, start_position=s) for s in steps], 1)


def test_a_reserved_cache_computes_what_a_growing_one_does_written_in_place():
    model = tiny_llama()
    ids = torch.arange(3, 43).unsqueeze(0)  # 40 tokens: chunks of 16, 16 and 8
    grown, reserved = new_full_cache(), new_full_cache(capacity=40)
    expected = _chunked(model, ids, grown, 16)
    with torch.inference_mode():
        first = forward_with_cache(model, ids[:, :16], reserved, start_position=0)
    first_blocks = [layer.keys.data_ptr() for layer in reserved.layers]
    logits = torch.cat([first, _chunked_from(model, ids, reserved)], dim=1)
    torch.testing.assert_close(logits, expected)
    for layer, grown_layer, block in zip(reserved.layers, grown.layers, first_blocks, strict=True):
        assert isinstance(layer, ReservedLayer)
        assert layer.keys.data_ptr() == block  # every chunk written where the first was: nothing grown by copying
        assert layer.keys.is_contiguous()  # full: the whole buffer, as compression reads it
        assert torch.equal(layer.keys, grown_layer.keys) and torch.equal(layer.values, grown_layer.values)


def _chunked_from(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """The rest of ``ids`` after the 16 tokens ``cache`` holds, 16 at a time."""
    with torch.inference_mode():
        return torch.cat([forward_with_cache(model, ids[:, s : s + 16], cache, start_position=s) for s in (16, 32)], 1)


def test_a_reserved_cache_past_its_capacity_grows_as_a_dynamic_one():
    model = tiny_llama()
    ids = torch.arange(3, 43).unsqueeze(0)
    expected = _chunked(model, ids, new_full_cache(), 16)
    small = new_full_cache(capacity=20)  # the second chunk does not fit
    torch.testing.assert_close(_chunked(model, ids, small, 16), expected)
    assert small.get_seq_length() == 40
