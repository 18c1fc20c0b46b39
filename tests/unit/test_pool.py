"""SharedKVPool on a tiny random Llama: sizes from tensors, immutability, fingerprint, bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import tiny_llama
from transformers import BertConfig, BertModel

from polykv_agents import CodecConfig, CompressionConfig, PooledAgent, SharedKVPool
from polykv_agents.model.compat import layer_key_values
from polykv_agents.model.fingerprint import ModelFingerprint
from polykv_agents.pool import shared_pool as shared_pool_module
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import pool_digest

DOC = "Shared caches let many agents read one document. " * 12


def test_nbytes_is_the_sum_of_stored_tensors(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    stored = sum(t.nbytes for layer in pool.layers for enc in (layer.keys, layer.values) for t in enc.tensors.values())
    assert pool.nbytes == stored
    assert pool.num_layers == tiny_model.config.num_hidden_layers


def test_fp16_and_model_dtype_bytes_are_measured_from_the_prefill_cache(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    cache, _ = prefill_cache(tiny_model, pool.token_ids)
    kv = layer_key_values(cache)
    assert pool.model_dtype_nbytes == sum(k.nbytes + v.nbytes for k, v in kv)
    assert pool.fp16_nbytes == sum(k.half().nbytes + v.half().nbytes for k, v in kv)
    assert pool.compression_ratio == pytest.approx(pool.fp16_nbytes / pool.nbytes)


def test_compressed_pool_is_smaller_than_fp16_and_full_precision_pool_is_not(tiny_model, tiny_tok):
    compressed = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    full = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=CompressionConfig.full_precision())
    assert compressed.compression_ratio > 2.0
    assert full.nbytes == full.model_dtype_nbytes  # stored exactly as produced (fp32 here)


def test_pool_is_read_only_and_agents_never_write_it(tiny_model, tiny_tok):
    for config in (CompressionConfig(), CompressionConfig.full_precision()):
        pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=config)
        before = pool.tensor_checksum()
        with pytest.raises(AttributeError, match="read-only"):
            pool.config = CompressionConfig.paper()
        for role in ("planner", "critic"):
            PooledAgent(pool, tiny_model, tiny_tok, system_prompt=role).generate("Summarise.", max_new_tokens=5)
        pool.to_cache(tiny_model).update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
        assert pool.tensor_checksum() == before


def test_token_ids_property_returns_a_copy(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    ids = pool.token_ids
    ids.zero_()
    assert pool.token_ids.sum() > 0
    cache, _ = prefill_cache(tiny_model, pool.token_ids)
    narrow = SharedKVPool.from_cache(tiny_model, tiny_tok, cache, pool.token_ids.to(torch.int32))
    assert (narrow.token_ids.dtype, narrow.token_ids.device.type) == (torch.int64, "cpu")  # kept as [T] int64


def test_fingerprint_describes_the_model(tiny_model, tiny_tok):
    fp = SharedKVPool.prefill(tiny_model, tiny_tok, DOC).fingerprint
    assert (fp.architecture, fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype) == (
        "LlamaForCausalLM",
        2,
        2,
        16,
        "float32",
    )
    assert fp.vocab_size == len(tiny_tok)


def test_pool_refuses_a_different_model(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    other_weights = tiny_llama(seed=1)  # same architecture, other weights
    with pytest.raises(ValueError, match="weights_sha"):
        PooledAgent(pool, other_weights, tiny_tok)
    other_shape = tiny_llama(head_dim=32)
    with pytest.raises(ValueError, match="head_dim"):
        PooledAgent(pool, other_shape, tiny_tok)


def test_digest_is_deterministic_and_depends_on_document_and_config(tiny_model, tiny_tok):
    a = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    b = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    assert a.digest == b.digest and a.tensor_checksum() == b.tensor_checksum()
    assert SharedKVPool.prefill(tiny_model, tiny_tok, DOC + " More.").digest != a.digest
    assert SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=CompressionConfig.paper()).digest != a.digest


def test_the_digest_of_fixed_inputs_never_changes():
    """Saved pools and handles in checkpoints are found by digest: a change of this value must be deliberate
    (the last one: format 2, whose digest leaves the model's dtype out)."""
    fingerprint = ModelFingerprint(
        name="tiny",
        architecture="LlamaForCausalLM",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype="float32",
        vocab_size=320,
        weights_sha="0123456789abcdef",
        tokenizer_sha="fedcba9876543210",
    )
    ids = torch.tensor([5, 6, 7], dtype=torch.int32)  # hashed as int64, whatever the caller's dtype
    assert pool_digest(fingerprint, CompressionConfig(), ids, chat_prefix=False) == (
        "70dcad78cc8f5e30484fb8b2fde707a39337d33bcb101cb821c7cb64e846b490"
    )
    assert pool_digest(fingerprint, CompressionConfig(), ids, chat_prefix=True) == (
        "7cae45ee6bc0f0c18afc3db884929c3512c7b261ab8830dbd36bc57a31aa8b39"
    )
    in_bf16 = fingerprint.model_copy(update={"dtype": "bfloat16"})
    assert pool_digest(in_bf16, CompressionConfig(), ids, chat_prefix=False) == (
        "70dcad78cc8f5e30484fb8b2fde707a39337d33bcb101cb821c7cb64e846b490"
    )


def test_a_built_pool_is_logged(tiny_model, tiny_tok, caplog):
    with caplog.at_level(logging.INFO, logger=shared_pool_module.__name__):
        pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    assert [r.getMessage() for r in caplog.records if r.name == shared_pool_module.__name__] == [f"built {pool!r}"]
    assert repr(pool).startswith(f"SharedKVPool(tokens={pool.num_tokens}, layers=2, ")
    assert repr(pool).endswith(f" vs fp16, digest={pool.digest[:12]})")


def test_chunk_size_does_not_change_the_cache(tiny_model, tiny_tok):
    full = CompressionConfig.full_precision()
    one = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=full, chunk_size=10_000)
    chunked = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=full, chunk_size=37)
    for i in range(one.num_layers):
        for x, y in zip(one.decompress_layer(i), chunked.decompress_layer(i), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_layers_are_decoded_in_the_dtype_and_on_the_device_asked_for(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)  # float32 on the CPU
    keys, values = pool.decompress_layer(1, dtype=torch.bfloat16, device="meta")  # "meta": a device besides the CPU
    assert (keys.dtype, values.dtype, keys.device.type, values.device.type) == (torch.bfloat16,) * 2 + ("meta",) * 2
    assert keys.shape == values.shape == (1, 2, pool.num_tokens, 16)  # [1, kv_heads, T, head_dim]
    reader = tiny_llama().to(device="meta", dtype=torch.bfloat16)  # another dtype and device than the builder's
    for keys, values in layer_key_values(pool.to_cache(reader)):
        assert (keys.dtype, values.dtype, keys.device.type, values.device.type) == (torch.bfloat16,) * 2 + ("meta",) * 2


def test_keys_and_values_get_seeds_of_their_own_from_the_config_seed(tiny_model, tiny_tok):
    config = CompressionConfig(keys=CodecConfig(method="turboquant", bits=4), seed=5)
    layer = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=config).layers[0]
    assert (layer.keys.params["seed"], layer.values.params["seed"]) == (5, 6)  # independent rotation signs


def test_a_cache_shorter_than_the_document_is_refused(tiny_model, tiny_tok):
    ids = SharedKVPool.prefill(tiny_model, tiny_tok, DOC).token_ids  # [T]
    cache, _ = prefill_cache(tiny_model, ids[:-1])  # what a sliding-window layer keeps: fewer positions than T
    message = (
        rf"^a cache layer kept {ids.numel() - 1} of the document's {ids.numel()} tokens \(a sliding-window layer "
        r"shorter than the document\); shorten the document below the model's sliding window$"
    )
    with pytest.raises(ValueError, match=message):
        SharedKVPool.from_cache(tiny_model, tiny_tok, cache, ids)


def test_progress_callback_reports_every_chunk(tiny_model, tiny_tok):
    seen = []
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, chunk_size=50, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (pool.num_tokens, pool.num_tokens)
    assert len(seen) == -(-pool.num_tokens // 50)


def test_chat_messages_prefix_is_rendered_with_the_template(tiny_model, tiny_tok):
    messages = [{"role": "system", "content": "Shared instructions."}, {"role": "user", "content": DOC}]
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, messages)
    text = tiny_tok.decode(pool.token_ids)
    assert text.startswith("<|im_start|>system\nShared instructions.<|im_end|>")
    assert pool.prefix_messages[1]["content"] == DOC


@pytest.mark.parametrize("head_dim", [80, 96, 112])
def test_non_power_of_two_head_dim_models_work(tiny_tok, head_dim):
    model = tiny_llama(head_dim=head_dim)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    keys, values = pool.decompress_layer(0)
    cache, _ = prefill_cache(model, pool.token_ids)
    ref_keys, ref_values = layer_key_values(cache)[0]
    assert keys.shape == ref_keys.shape and keys.shape[-1] == head_dim
    value_error = ((values - ref_values).norm(dim=-1) ** 2 / ref_values.norm(dim=-1) ** 2).mean()
    assert value_error < 0.06  # 3-bit TurboQuant: about 0.035 on near-Gaussian data
    PooledAgent(pool, model, tiny_tok).generate("Go on.", max_new_tokens=3)


@pytest.mark.parametrize("document", ["", "   \n\t ", b"\xff\xfe not utf-8", []])
def test_empty_or_undecodable_documents_are_refused(tiny_model, tiny_tok, document):
    with pytest.raises(ValueError, match=r"empty|UTF-8"):
        SharedKVPool.prefill(tiny_model, tiny_tok, document)


def test_document_longer_than_the_model_is_refused(tiny_model, tiny_tok):
    with pytest.raises(ValueError, match="at most 1024 positions"):
        SharedKVPool.prefill(tiny_model, tiny_tok, "word " * 3000)


def test_a_model_that_is_not_a_causal_lm_is_refused(tiny_tok):
    encoder = BertModel(BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(TypeError, match="not a causal language model"):
        SharedKVPool.prefill(encoder, tiny_tok, DOC)


def test_memory_report_scales_measured_single_copies(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    report = pool.memory_report(15)
    assert report.pool_nbytes == pool.nbytes
    assert report.separate_fp16_nbytes == 15 * pool.fp16_nbytes
    assert 0.9 < report.saving_vs_fp16 < 1.0
    with pytest.raises(ValueError, match="n_agents"):
        pool.memory_report(0)


def test_other_configs_go_through_the_same_object(tiny_model, tiny_tok):
    both_tq = CompressionConfig(keys=CodecConfig(method="turboquant", bits=4))
    int8_values = CompressionConfig(values=CodecConfig(method="int", bits=8, granularity="token"))
    sizes = {
        c.label(): SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=c).nbytes
        for c in (CompressionConfig(), both_tq, int8_values)
    }
    assert sizes["K:tq4 V:tq3"] < sizes["K:int8/channel V:tq3"] < sizes["K:int8/channel V:int8/token"]


CENTERED_PRE_ROPE = CompressionConfig(
    keys=CodecConfig(method="centered_turboquant", bits=4, before_rope=True), values=CompressionConfig().values
)


def test_keys_compressed_before_rope_carry_each_layers_own_frequencies(tiny_tok):
    from tiny_models import tiny_gemma3

    from polykv_agents.model.rope import rope_frequencies

    model = tiny_gemma3()  # sliding layers rotate with a local base, the global layer with another
    pool = SharedKVPool.prefill(model, tiny_tok, DOC, config=CENTERED_PRE_ROPE)
    cache, _ = prefill_cache(model, pool.token_ids)
    for index, (keys, _values) in enumerate(layer_key_values(cache)):
        assert torch.equal(pool.layers[index].keys.tensors["rope_inv_freq"], rope_frequencies(model, index))
        decoded, _ = pool.decompress_layer(index, dtype=torch.float32)
        assert torch.equal(decoded[:, :, :4], keys[:, :, :4])  # sinks as they were
        assert float((decoded - keys).norm() / keys.norm()) < 0.15


def test_layer_codecs_compress_their_layers_with_their_own_codecs(tiny_tok):
    from tiny_models import tiny_gemma3

    from polykv_agents import LayerCodecs
    from polykv_agents.model.rope import rope_frequencies

    model = tiny_gemma3()
    last = model.config.num_hidden_layers - 1
    mixed = CompressionConfig(
        keys=CodecConfig(method="turboquant", bits=3),
        values=CodecConfig(method="turboquant", bits=3),
        layers=[
            LayerCodecs(layers=(-1,), keys=CENTERED_PRE_ROPE.keys),  # before RoPE on the last layer only
            LayerCodecs(layers=(0,), values=CodecConfig(method="int", bits=8, granularity="token")),
        ],
        seed=3,
    )
    pool = SharedKVPool.prefill(model, tiny_tok, DOC, config=mixed)
    records = [(layer.keys.codec, layer.keys.params["bits"], layer.values.codec) for layer in pool.layers]
    assert records[0] == ("turboquant", 3, "int")
    assert records[1:last] == [("turboquant", 3, "turboquant")] * (last - 1)
    assert records[last] == ("centered_turboquant", 4, "turboquant")
    assert torch.equal(pool.layers[last].keys.tensors["rope_inv_freq"], rope_frequencies(model, last))
    assert pool.layers[last].keys.params["seed"] == 3 and pool.layers[1].values.params["seed"] == 4
    uniform = SharedKVPool.prefill(
        model, tiny_tok, DOC, config=CompressionConfig(keys=mixed.keys, values=mixed.values, seed=3)
    )
    for index in range(1, last):  # layers without an exception are exactly the uniform config's
        pairs = zip(pool.decompress_layer(index), uniform.decompress_layer(index), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    assert pool.nbytes > uniform.nbytes  # int8 values and 4-bit keys on two layers: measured, not computed
    assert pool.digest != uniform.digest


def test_layer_codecs_naming_a_layer_the_model_lacks_are_refused(tiny_model, tiny_tok):
    from polykv_agents import LayerCodecs

    config = CompressionConfig(layers=[LayerCodecs(layers=(2,), keys=CodecConfig(method="int", bits=4))])
    with pytest.raises(ValueError, match="names layer 2, but the model has 2 layers"):
        SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=config)
