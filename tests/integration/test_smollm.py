"""The foundation on the real embedded model, SmolLM2-135M-Instruct (loaded once per session)."""

from __future__ import annotations

import pytest
import torch

from polykv_agents import CompressionConfig, GenerationSettings, PooledAgent, SharedKVPool, load_model

pytestmark = pytest.mark.real_model

QUESTION = "What are the three principal risks the Board identified?"


@pytest.fixture(scope="module")
def chat_document(sample_document):
    return [
        {"role": "system", "content": "You are one of several analysts who share the document below."},
        {"role": "user", "content": sample_document},
    ]


@pytest.fixture(scope="module")
def compressed_pool(smollm, chat_document):
    model, tokenizer = smollm
    return SharedKVPool.prefill(model, tokenizer, chat_document)


def test_embedded_model_is_the_30_layer_gqa_llama_and_is_loaded_once(smollm):
    model, _ = smollm
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert load_model() is smollm


def test_full_precision_pool_reproduces_plain_generate(smollm, chat_document):
    model, tokenizer = smollm
    pool = SharedKVPool.prefill(model, tokenizer, chat_document, config=CompressionConfig.full_precision())
    agent = PooledAgent(pool, model, tokenizer, system_prompt="You are the risk officer.")
    pooled = list(agent.generate_ids(QUESTION, GenerationSettings(max_new_tokens=24)))
    ids = torch.cat([pool.token_ids, agent.prompt_ids(QUESTION)]).unsqueeze(0)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert pooled == reference[0, ids.shape[-1] :].tolist()[: len(pooled)]
    assert len(pooled) >= 12


def test_compressed_pool_measures_at_least_2_8x_smaller_than_fp16(compressed_pool):
    # Measured from the stored tensors; the arithmetic limit with one fp16 norm per 64-d vector is 2.84x.
    assert compressed_pool.compression_ratio >= 2.80
    assert compressed_pool.fingerprint.num_layers == 30


def test_agents_answer_from_the_compressed_pool(smollm, compressed_pool):
    model, tokenizer = smollm
    before = compressed_pool.tensor_checksum()
    agent = PooledAgent(
        compressed_pool, model, tokenizer, system_prompt="You are the risk officer. Be brief and list items."
    )
    answer = agent.generate(QUESTION, max_new_tokens=64).lower()
    assert sum(word in answer for word in ("drought", "mains", "workforce")) >= 2, answer
    assert compressed_pool.tensor_checksum() == before


def test_pooled_agent_refuses_a_pool_from_another_model(compressed_pool, tiny_model, tiny_tok):
    with pytest.raises(ValueError, match="cannot be read with"):
        PooledAgent(compressed_pool, tiny_model, tiny_tok)


def test_ignore_eos_decodes_exactly_max_tokens_for_equal_work_benchmarks(compressed_pool):
    from langchain_core.messages import HumanMessage

    from polykv_agents import ChatPolyKV

    chat = ChatPolyKV(max_tokens=40).with_pool(compressed_pool)
    question = [HumanMessage("Answer with one word: yes or no?")]
    natural = chat.invoke(question)
    assert natural.usage_metadata["output_tokens"] < 40  # the model ends its short answer itself
    forced = chat.model_copy(update={"ignore_eos": True}).invoke(question)
    assert forced.usage_metadata["output_tokens"] == 40
    assert forced.response_metadata["finish_reason"] == "length"
    # A grammar still decides where a structured answer ends.
    schema = {"title": "Answer", "type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
    structured = chat.model_copy(update={"ignore_eos": True}).with_structured_output(schema, include_raw=True)
    result = structured.invoke(question)
    assert isinstance(result["parsed"]["yes"], bool) and result["raw"].usage_metadata["output_tokens"] < 40
