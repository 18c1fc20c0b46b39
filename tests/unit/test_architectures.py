"""Every supported architecture family, on tiny random models: exact pooled generation, compression end to
end, and clear errors for what a pool cannot hold.

The families each carry the trait they are here for: GQA (Llama), q/k/v bias (Qwen2), sliding window on
every layer (Mistral), head_dim 96 and a fused qkv projection (Phi-3), head_dim 256 with soft-capping and
alternating sliding/global layers (Gemma 2, eager attention), multi-head Conv1D attention (GPT-2).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from tiny_models import FAMILIES, SLIDING_WINDOW, assert_pairwise_distinct, tiny_causal_lm, tiny_gemma3

from polykv_agents import CompressionConfig, GenerationSettings, PooledAgent, SharedKVPool
from polykv_agents.eval.perplexity import perplexity_deltas
from polykv_agents.model.compat import forward_with_cache, new_dynamic_cache, new_full_cache
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.pool.store import PoolStore
from polykv_agents.runtime.cascade_attention import enable_cascade_attention
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler import BatchScheduler

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook."
QUESTIONS = ("What do values use?", "Summarise it.", "Which part is rotated, and why would that matter?")
NEW_TOKENS = 40


@functools.cache
def model_of(family: str):
    return tiny_causal_lm(family)


def plain_greedy(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """transformers' own greedy generate over document + prompt, no pool involved."""
    out = model.generate(
        ids.unsqueeze(0),
        attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, ids.numel() :].tolist()


def pooled_greedy(agent: PooledAgent, question: str) -> list[int]:
    return list(agent.generate_ids(question, GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)))


@pytest.mark.parametrize("runtime", ["private", "decompressed", "compressed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_uncompressed_pool_reproduces_plain_generation(family, runtime, tiny_tok):
    model = model_of(family)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC, config=CompressionConfig.full_precision())
    agent = PooledAgent(pool, model, tiny_tok, system_prompt="You are the critic.", runtime=runtime)
    ids = torch.cat([pool.token_ids, agent.prompt_ids(QUESTIONS[0])])
    # The answer runs past the sliding window, so window masking over the shared prefix is exercised.
    assert pool.num_tokens < SLIDING_WINDOW < ids.numel() + NEW_TOKENS
    assert pooled_greedy(agent, QUESTIONS[0]) == plain_greedy(model, ids, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_agents_each_reproduce_plain_generation(family, tiny_tok):
    """Batched rows of different prompt lengths (left padding), each past the window at its own step."""
    assert_concurrent_agents_reproduce_plain_generation(model_of(family), tiny_tok, DOC)


def assert_concurrent_agents_reproduce_plain_generation(model, tokenizer, document: str) -> None:
    """Every question at once over one uncompressed pool of ``document``: each answer is plain ``generate``'s."""
    pool = SharedKVPool.prefill(model, tokenizer, document, config=CompressionConfig.full_precision())
    agent = PooledAgent(pool, model, tokenizer)
    with ThreadPoolExecutor(len(QUESTIONS)) as executor:
        answers = list(executor.map(lambda q: pooled_greedy(agent, q), QUESTIONS))
    for question, answer in zip(QUESTIONS, answers, strict=True):
        ids = torch.cat([pool.token_ids, agent.prompt_ids(question)])
        assert answer == plain_greedy(model, ids, NEW_TOKENS), question


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_admitted_in_packed_chunks_while_a_row_decodes_each_reproduce_plain_generation(family, tiny_tok):
    """Two prompts of different lengths join a decoding row, three prompt tokens of each per step, every step one
    forward with the running row's token (runtime/packed_step.py): the flat sequence split back per group (left
    padding, positions, sliding windows, soft-capping) must give each row exactly its own answer."""
    model = model_of(family)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC, config=CompressionConfig.full_precision())
    agent = PooledAgent(pool, model, tiny_tok)
    scheduler = BatchScheduler(model, tiny_tok, pool, admission_chunk_tokens=6)
    packed_steps = []
    packed_step = scheduler._packed_step
    scheduler._packed_step = lambda: packed_steps.append(len(scheduler._admission.requests)) or packed_step()
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [agent.prompt_ids(question) for question in QUESTIONS]

    def submit(prompt):
        return scheduler.submit(DecodeRequest(model, tiny_tok, prompt, settings, pool=pool), NEW_TOKENS)

    first = submit(prompts[0])
    answers = [[next(first)]]
    # Queued while this thread holds the compute thread, so no step runs between them: one admission of two rows.
    joining = run_on_compute_thread(lambda: [submit(prompt) for prompt in prompts[1:]])
    answers += [list(stream) for stream in joining]
    answers[0] += list(first)
    scheduler.close()

    assert packed_steps and set(packed_steps) == {2}
    expected = [plain_greedy(model, torch.cat([pool.token_ids, prompt]), NEW_TOKENS) for prompt in prompts]
    assert_pairwise_distinct(expected)
    assert answers == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_default_compression_runs_end_to_end(family, tiny_tok, tmp_path):
    model = model_of(family)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    assert pool.compression_ratio > 2.0  # measured from the stored tensors
    store = PoolStore(tmp_path)
    store.save(pool)
    loaded = store.load(pool.digest)
    assert loaded.tensor_checksum() == pool.tensor_checksum()
    for runtime in ("private", "decompressed"):
        answer = pooled_greedy(PooledAgent(loaded, model, tiny_tok, runtime=runtime), QUESTIONS[1])
        assert len(answer) == NEW_TOKENS


@pytest.mark.parametrize("base", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_switching_to_cascade_attention_keeps_ordinary_calls_exact(family, base):
    """Plain forward passes (prefill, ``generate``) run the attention the model had before the switch."""
    if family == "gemma2" and base == "sdpa":
        pytest.skip("transformers' sdpa refuses Gemma 2's soft-capping")
    model = tiny_causal_lm(family, seed=7)
    model.set_attn_implementation(base)
    ids = torch.arange(3, 60).unsqueeze(0)
    with torch.inference_mode():
        before = model(ids).logits
        enable_cascade_attention(model)
        assert model.config._attn_implementation.startswith("polykv_cascade")
        after = model(ids).logits
    assert torch.equal(before, after)


LONG_DOC = DOC * 6
"""About three sliding windows of the tiny models' (64 tokens)."""


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_full_cache_prefills_what_a_sliding_cache_does(family):
    """A pool's prefill keeps every token in every layer; the model's masks still apply each layer's window."""
    model = model_of(family)
    ids = (torch.arange(3 * SLIDING_WINDOW) % 300 + 3).unsqueeze(0)
    by_cache = {}
    for name, cache in (("sliding", new_dynamic_cache(model)), ("full", new_full_cache())):
        chunks = [
            forward_with_cache(model, ids[:, s : s + 50], cache, start_position=s) for s in range(0, ids.numel(), 50)
        ]
        by_cache[name] = torch.cat(chunks, dim=1)
    assert torch.allclose(by_cache["full"], by_cache["sliding"], atol=1e-5)
    assert all(layer.keys.shape[-2] == ids.numel() for layer in cache.layers)  # the full cache kept every token


@pytest.mark.parametrize("runtime", ["private", "decompressed", "compressed"])
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_document_longer_than_the_sliding_window_is_pooled_whole_and_exact(family, runtime, tiny_tok):
    model = model_of(family)
    pool = SharedKVPool.prefill(model, tiny_tok, LONG_DOC, config=CompressionConfig.full_precision())
    assert pool.num_tokens > 2 * SLIDING_WINDOW
    assert all(pool.decompress_layer(i)[0].shape[-2] == pool.num_tokens for i in range(pool.num_layers))
    agent = PooledAgent(pool, model, tiny_tok, system_prompt="You are the critic.", runtime=runtime)
    ids = torch.cat([pool.token_ids, agent.prompt_ids(QUESTIONS[0])])
    assert pooled_greedy(agent, QUESTIONS[0]) == plain_greedy(model, ids, NEW_TOKENS)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_concurrent_agents_over_a_pool_longer_than_the_window_each_reproduce_plain_generation(family, tiny_tok):
    assert_concurrent_agents_reproduce_plain_generation(model_of(family), tiny_tok, LONG_DOC)


@pytest.mark.parametrize("runtime", ["private", "decompressed", "compressed"])
def test_gemma3_over_a_pool_of_three_windows_reproduces_plain_generation(runtime, tiny_tok):
    """Gemma 3's mix (local layers and a global one, each kind with its own RoPE base) over a pool longer
    than its window: what the second model family exercises at real scale (``bench tasks --model``)."""
    model = tiny_gemma3()
    pool = SharedKVPool.prefill(model, tiny_tok, LONG_DOC, config=CompressionConfig.full_precision())
    agent = PooledAgent(pool, model, tiny_tok, runtime=runtime)
    ids = torch.cat([pool.token_ids, agent.prompt_ids(QUESTIONS[2])])
    assert pool.num_tokens > 2 * SLIDING_WINDOW and model.config.layer_types.count("full_attention") == 1
    assert pooled_greedy(agent, QUESTIONS[2]) == plain_greedy(model, ids, NEW_TOKENS)


def test_perplexity_past_the_sliding_window_is_measured_and_full_precision_changes_nothing(tiny_tok):
    (result,) = perplexity_deltas(
        model_of("mistral"), tiny_tok, LONG_DOC * 2, context_tokens=3 * SLIDING_WINDOW, continuation_tokens=20,
        configs=[CompressionConfig.full_precision()],
    )  # fmt: skip
    assert result.delta_pct == pytest.approx(0.0, abs=1e-3)


def _mamba():
    config = transformers.MambaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, state_size=4)
    return transformers.AutoModelForCausalLM.from_config(config)


def _jamba():
    config = transformers.JambaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        num_experts=2,
        mamba_d_state=4,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _t5():
    config = transformers.T5Config(vocab_size=320, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    return transformers.AutoModelForSeq2SeqLM.from_config(config)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [(_mamba, "recurrent, hybrid"), (_jamba, "recurrent, hybrid"), (_t5, "encoder-decoder")],
    ids=["mamba-recurrent", "jamba-hybrid", "t5-encoder-decoder"],
)
def test_models_whose_cache_a_pool_cannot_hold_are_refused(build, fragment, tiny_tok):
    with pytest.raises(TypeError, match=fragment):
        SharedKVPool.prefill(build(), tiny_tok, DOC)
