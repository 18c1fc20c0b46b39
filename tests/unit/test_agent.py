"""PooledAgent on a tiny random Llama: exact continuation of the pool, streaming, stops, settings."""

from __future__ import annotations

import copy

import pytest
import torch

from polykv_agents import CompressionConfig, GenerationSettings, PooledAgent, SharedKVPool

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 8
QUESTION = "What do values use?"


def plain_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Reference: transformers' own generate over document + question, no pool involved."""
    ids = prompt_ids.unsqueeze(0)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    generated = out[0, ids.shape[-1] :].tolist()
    eos = model.generation_config.eos_token_id
    return generated[: generated.index(eos)] if eos in generated else generated


@pytest.mark.parametrize("chat_prefix", [False, True], ids=["text-document", "chat-document"])
@pytest.mark.parametrize("chunk_size", [512, 23])
def test_full_precision_pool_reproduces_plain_generate(tiny_model, tiny_tok, chat_prefix, chunk_size):
    document = [{"role": "system", "content": "Read this."}, {"role": "user", "content": DOC}] if chat_prefix else DOC
    pool = SharedKVPool.prefill(
        tiny_model, tiny_tok, document, config=CompressionConfig.full_precision(), chunk_size=chunk_size
    )
    agent = PooledAgent(pool, tiny_model, tiny_tok, system_prompt="You are a critic.")
    pooled = list(agent.generate_ids(QUESTION, GenerationSettings(max_new_tokens=48)))
    reference = plain_generate(tiny_model, torch.cat([pool.token_ids, agent.prompt_ids(QUESTION)]), 48)
    assert len(pooled) > 10
    assert pooled == reference


def test_compressed_pool_stays_close_to_full_precision(tiny_model, tiny_tok):
    """Not exact (the cache is quantised), but the first greedy tokens of a random model agree."""
    full = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=CompressionConfig.full_precision())
    compressed = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    a = list(PooledAgent(full, tiny_model, tiny_tok).generate_ids(QUESTION))[:3]
    b = list(PooledAgent(compressed, tiny_model, tiny_tok).generate_ids(QUESTION))[:3]
    assert a == b


def test_agent_turns_follow_the_chat_prefix_as_natural_turns(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, [{"role": "user", "content": DOC}])
    agent = PooledAgent(pool, tiny_model, tiny_tok, system_prompt="You are the planner.")
    suffix = tiny_tok.decode(agent.prompt_ids(QUESTION))
    assert suffix == (
        "<|im_start|>system\nYou are the planner.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_an_answer_prefix_ends_the_prompt_inside_the_answer_and_is_continued(tiny_model, tiny_tok):
    prefix = "The answer is"
    chat_pool = SharedKVPool.prefill(tiny_model, tiny_tok, [{"role": "user", "content": DOC}])
    agent = PooledAgent(chat_pool, tiny_model, tiny_tok, system_prompt="You are the planner.")
    suffix = tiny_tok.decode(agent.prompt_ids(QUESTION, answer_prefix=prefix))
    assert suffix.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n{prefix}")
    base_tok = copy.deepcopy(tiny_tok)
    base_tok.chat_template = None  # a base model: the plain User/Assistant format
    text_pool = SharedKVPool.prefill(tiny_model, base_tok, DOC, config=CompressionConfig.full_precision())
    plain = PooledAgent(text_pool, tiny_model, base_tok)
    assert base_tok.decode(plain.prompt_ids(QUESTION, answer_prefix=prefix)).endswith(f"\nAssistant: {prefix}")
    # what is generated continues the prefix, exactly as plain generate over the same ids would
    ids = plain.prompt_ids(QUESTION, answer_prefix=prefix)
    reference = base_tok.decode(plain_generate(tiny_model, torch.cat([text_pool.token_ids, ids]), 12))
    assert plain.generate(QUESTION, max_new_tokens=12, answer_prefix=prefix) == reference
    assert reference != plain.generate(QUESTION, max_new_tokens=12)


def test_stream_pieces_join_to_generate(tiny_model, tiny_tok):
    agent = PooledAgent(SharedKVPool.prefill(tiny_model, tiny_tok, DOC), tiny_model, tiny_tok)
    pieces = list(agent.stream(QUESTION, max_new_tokens=40))
    assert len(pieces) > 1
    assert "".join(pieces) == agent.generate(QUESTION, max_new_tokens=40)


def test_stop_sequence_cuts_the_answer_streaming_and_not(tiny_model, tiny_tok):
    agent = PooledAgent(SharedKVPool.prefill(tiny_model, tiny_tok, DOC), tiny_model, tiny_tok)
    free = agent.generate(QUESTION, max_new_tokens=60)
    stop = free[10:14]  # a multi-character string that does occur
    assert len(stop) == 4
    expected = free[: free.index(stop)]
    assert agent.generate(QUESTION, max_new_tokens=60, stop=[stop]) == expected
    assert "".join(agent.stream(QUESTION, max_new_tokens=60, stop=stop)) == expected
    assert agent.generate(QUESTION, max_new_tokens=60, stop=["never occurs \u2603"]) == free


def test_max_new_tokens_zero_returns_empty_without_running(tiny_model, tiny_tok):
    agent = PooledAgent(SharedKVPool.prefill(tiny_model, tiny_tok, DOC), tiny_model, tiny_tok)
    assert agent.generate(QUESTION, max_new_tokens=0) == ""


def test_sampling_is_reproducible_with_a_seed(tiny_model, tiny_tok):
    agent = PooledAgent(SharedKVPool.prefill(tiny_model, tiny_tok, DOC), tiny_model, tiny_tok)
    kwargs = {"max_new_tokens": 20, "temperature": 1.5, "top_p": 0.95}
    assert agent.generate(QUESTION, seed=3, **kwargs) == agent.generate(QUESTION, seed=3, **kwargs)
    samples = {agent.generate(QUESTION, seed=s, **kwargs) for s in range(4)}
    assert len(samples) > 1


def test_invalid_settings_and_questions_are_refused(tiny_model, tiny_tok):
    agent = PooledAgent(SharedKVPool.prefill(tiny_model, tiny_tok, DOC), tiny_model, tiny_tok)
    with pytest.raises(ValueError, match="max_new_tokens"):
        agent.generate(QUESTION, max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        agent.generate(QUESTION, top_p=0.0)
    with pytest.raises(ValueError, match="question is empty"):
        agent.generate("  ")


def test_generation_stops_at_the_models_last_position(tiny_model, tiny_tok):
    """A pool close to max_position_embeddings (1024) gets a shortened budget, not an index error."""
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, "abc " * 310)
    agent = PooledAgent(pool, tiny_model, tiny_tok)
    room = 1024 - pool.num_tokens - agent.prompt_ids(QUESTION).numel()
    assert 0 < room < 200
    assert len(list(agent.generate_ids(QUESTION))) <= room


def test_many_threads_read_one_pool_at_once(tiny_model, tiny_tok):
    """Write once, read many: concurrent agents get exactly their sequential answers."""
    from concurrent.futures import ThreadPoolExecutor

    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    checksum = pool.tensor_checksum()
    roles = [f"You are agent {i}." for i in range(6)]
    settings = GenerationSettings(max_new_tokens=12)

    def answer(role: str) -> list[int]:
        return list(PooledAgent(pool, tiny_model, tiny_tok, system_prompt=role).generate_ids(QUESTION, settings))

    sequential = [answer(role) for role in roles]
    with ThreadPoolExecutor(max_workers=6) as executor:
        concurrent = list(executor.map(answer, roles))
    assert concurrent == sequential
    assert pool.tensor_checksum() == checksum
