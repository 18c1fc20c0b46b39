"""Multi-document pools (``compose_pools``) and the two steps they are made of, moving keys and recomputing tokens
in place, on the tiny families: exact where exactness is owed, clear errors where moving cannot work."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import FAMILIES, tiny_causal_lm, tiny_llama
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from polykv_agents import CompressionConfig, GenerationSettings, PooledAgent, SharedKVPool
from polykv_agents.model.compat import layer_key_values
from polykv_agents.model.rope import move_keys, rotary_embedding
from polykv_agents.pool.compose import compose_pools
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.recompute import recompute_in_place
from polykv_agents.pool.store import PoolStore

FIRST = "Keys are quantised to eight bits."
SECOND = "Values use a rotated three-bit codebook."
MOVABLE = tuple(family for family in FAMILIES if family != "gpt2")
FULL = CompressionConfig.full_precision()


@functools.cache
def model_of(family: str):
    return tiny_causal_lm(family)


def decoded(pool: SharedKVPool, model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [pool.decompress_layer(i, dtype=model.dtype) for i in range(pool.num_layers)]


@pytest.mark.parametrize("family", MOVABLE)
def test_moved_keys_are_the_keys_a_prefill_at_the_new_position_computes(family, tiny_tok):
    """The first layer's keys depend on the token and its position only: moved ones must match exactly."""
    model = model_of(family)
    ids = tiny_tok(FIRST, return_tensors="pt").input_ids[0]
    at_zero, _ = prefill_cache(model, ids)
    shifted = torch.cat([tiny_tok(SECOND, return_tensors="pt").input_ids[0], ids])
    later, _ = prefill_cache(model, shifted)
    keys_at_zero = layer_key_values(at_zero)[0][0]
    keys_later = layer_key_values(later)[0][0][:, :, -ids.numel() :]
    shift = shifted.numel() - ids.numel()
    assert not torch.allclose(keys_at_zero, keys_later, atol=1e-3)  # the position is visible in the keys
    torch.testing.assert_close(move_keys(model, keys_at_zero, shift), keys_later, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", MOVABLE)
def test_recomputing_every_token_in_place_is_a_full_prefill(family, tiny_tok):
    """Zeroed entries at scattered positions, recomputed in one masked forward, equal a prefill's."""
    model = model_of(family)
    ids = tiny_tok(FIRST + " " + SECOND, return_tensors="pt").input_ids[0]
    reference, _ = prefill_cache(model, ids)
    cache = DynamicCache()  # full-attention layers, as compose_pools builds
    for i, (keys, values) in enumerate(layer_key_values(reference)):
        cache.update(keys.clone(), values.clone(), i)
    positions = torch.tensor([1, 4, 5, ids.numel() - 1])
    with torch.inference_mode():
        for keys, values in layer_key_values(cache):
            keys[:, :, positions] = 0.0
            values[:, :, positions] = 0.0
    recompute_in_place(model, cache, ids[positions], positions)
    for (k, v), (rk, rv) in zip(layer_key_values(cache), layer_key_values(reference), strict=True):
        assert k.shape == rk.shape  # the appended copies are cropped again
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", MOVABLE)
def test_composed_pool_fully_recomputed_generates_what_one_prefill_of_both_documents_does(family, tiny_tok):
    model = model_of(family)
    first = SharedKVPool.prefill(model, tiny_tok, FIRST, config=FULL)
    second = SharedKVPool.prefill(model, tiny_tok, SECOND, config=FULL)
    composed = compose_pools(model, tiny_tok, [first, second], recompute=1.0)
    together = SharedKVPool.prefill_tokens(model, tiny_tok, torch.cat([first.token_ids, second.token_ids]), config=FULL)
    assert composed.token_ids.tolist() == together.token_ids.tolist()
    for (k, v), (rk, rv) in zip(decoded(composed, model), decoded(together, model), strict=True):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-4)
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    answers = [list(PooledAgent(p, model, tiny_tok).generate_ids("Summarise.", settings)) for p in (composed, together)]
    assert answers[0] == answers[1]


def test_without_recompute_the_first_part_is_exact_and_the_second_is_moved(tiny_tok):
    model = model_of("llama")
    first = SharedKVPool.prefill(model, tiny_tok, FIRST, config=FULL)
    second = SharedKVPool.prefill(model, tiny_tok, SECOND, config=FULL)
    composed = compose_pools(model, tiny_tok, [first, second], recompute=0.0)
    n = first.num_tokens
    layers, own = decoded(composed, model), decoded(second, model)
    for (k, v), (fk, fv) in zip(layers, decoded(first, model), strict=True):
        assert torch.equal(k[:, :, :n], fk) and torch.equal(v[:, :, :n], fv)
    for (k, v), (sk, sv) in zip(layers, own, strict=True):
        torch.testing.assert_close(k[:, :, n:], move_keys(model, sk, n))
        assert torch.equal(v[:, :, n:], sv)  # values carry no position
    assert composed.composition["recompute"] == 0.0
    # Deeper layers of the second part attended to it alone: not what a prefill of both computes.
    together = SharedKVPool.prefill_tokens(model, tiny_tok, composed.token_ids, config=FULL)
    assert not torch.allclose(layers[-1][1][:, :, n:], decoded(together, model)[-1][1][:, :, n:], atol=1e-4)


def test_composed_pools_in_either_order_and_never_under_the_digest_of_an_exact_pool(tiny_model, tiny_tok, tmp_path):
    first = SharedKVPool.prefill(tiny_model, tiny_tok, FIRST)
    second = SharedKVPool.prefill(tiny_model, tiny_tok, SECOND)
    forward = compose_pools(tiny_model, tiny_tok, [first, second], recompute=0.25)
    backward = compose_pools(tiny_model, tiny_tok, [second, first], recompute=0.25)
    assert backward.token_ids.tolist() == second.token_ids.tolist() + first.token_ids.tolist()
    exact = SharedKVPool.prefill_tokens(tiny_model, tiny_tok, forward.token_ids)
    assert forward.digest != exact.digest
    assert forward.composition["parts"] == [first.digest, second.digest]
    assert compose_pools(tiny_model, tiny_tok, [first, second], recompute=0.5).digest != forward.digest
    store = PoolStore(tmp_path)
    store.save(forward)
    reloaded = store.load(forward.digest)
    assert reloaded.digest == forward.digest and reloaded.composition == forward.composition


def test_a_pool_from_another_model_is_refused_before_any_work(tiny_model, tiny_tok):
    first = SharedKVPool.prefill(tiny_model, tiny_tok, FIRST)
    other = SharedKVPool.prefill(tiny_llama(seed=5, num_layers=3), tiny_tok, SECOND)
    with pytest.raises(ValueError, match=r"pools\[1\] was built with another model"):
        compose_pools(tiny_model, tiny_tok, [first, other])


def test_models_with_absolute_positions_are_refused_with_the_reason(tiny_tok):
    model = model_of("gpt2")
    pools = [SharedKVPool.prefill(model, tiny_tok, text) for text in (FIRST, SECOND)]
    with pytest.raises(ValueError, match="no rotary position embedding"):
        compose_pools(model, tiny_tok, pools)


@pytest.mark.parametrize(
    ("pools", "recompute", "error"),
    [
        (1, 0.0, "at least two pools"),
        (2, 1.5, "between 0 and 1"),
        (2, -0.1, "between 0 and 1"),
    ],
)
def test_bad_arguments_get_clear_errors(tiny_model, tiny_tok, pools, recompute, error):
    made = [SharedKVPool.prefill(tiny_model, tiny_tok, FIRST) for _ in range(pools)]
    with pytest.raises(ValueError, match=error):
        compose_pools(tiny_model, tiny_tok, made, recompute=recompute)


def test_more_tokens_than_the_sliding_window_holds_are_refused(tiny_tok):
    model = model_of("mistral")
    text = "Keys are quantised. " * 3
    pool = SharedKVPool.prefill(model, tiny_tok, text)
    assert pool.num_tokens * 2 > 64
    with pytest.raises(ValueError, match="sliding-window"):
        compose_pools(model, tiny_tok, [pool, pool])


def test_chat_and_plain_pools_do_not_mix_and_chat_pools_compose_as_one_conversation(tiny_model, tiny_tok):
    plain = SharedKVPool.prefill(tiny_model, tiny_tok, FIRST)
    chat = SharedKVPool.prefill(tiny_model, tiny_tok, [{"role": "system", "content": FIRST}])
    other = SharedKVPool.prefill(tiny_model, tiny_tok, [{"role": "user", "content": SECOND}])
    with pytest.raises(ValueError, match="mix chat-message documents and plain-text"):
        compose_pools(tiny_model, tiny_tok, [chat, plain])
    composed = compose_pools(tiny_model, tiny_tok, [chat, other])
    assert [m["content"] for m in composed.prefix_messages] == [FIRST, SECOND]


def test_rope_whose_rotation_depends_on_the_length_is_refused_with_the_reason():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    with pytest.raises(ValueError, match="'dynamic', whose rotation depends on the sequence length"):
        rotary_embedding(LlamaForCausalLM(config))


def test_rope_that_differs_by_layer_type_is_refused_with_the_reason():
    """Gemma 3 rotates its local and global layers with different bases: one move cannot serve both."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=64,
    )  # fmt: skip
    with pytest.raises(ValueError, match="differently by layer type"):
        rotary_embedding(Gemma3ForCausalLM(config))


def test_yarn_keys_move_without_its_attention_scaling_applied_twice(tiny_tok):
    """YaRN scales cos and sin by an attention factor; a move must rotate by R(d) alone."""
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 256},
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert rotary_embedding(model).attention_scaling != 1.0
    ids = tiny_tok(FIRST, return_tensors="pt").input_ids[0]
    at_zero, _ = prefill_cache(model, ids)
    later, _ = prefill_cache(model, torch.cat([ids, ids]))
    moved = move_keys(model, layer_key_values(at_zero)[0][0], ids.numel())
    torch.testing.assert_close(moved, layer_key_values(later)[0][0][:, :, ids.numel() :], atol=1e-5, rtol=1e-4)


def test_more_tokens_than_the_models_positions_are_refused(tiny_tok):
    model = tiny_llama(max_positions=64)
    pool = SharedKVPool.prefill(model, tiny_tok, "Keys are quantised. " * 3)
    assert pool.num_tokens < 64 <= 2 * pool.num_tokens
    with pytest.raises(ValueError, match=r"the composed pools hold .* covers at most 64 positions.*compose fewer"):
        compose_pools(model, tiny_tok, [pool, pool])
