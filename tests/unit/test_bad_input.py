"""Bad input and faults the other unit tests leave out, on the tiny random Llama.

Each test names the fault and checks either the exact behaviour or the error type plus the part of
the message that tells the user what to do.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from tiny_models import tiny_llama, tiny_tokenizer

from polykv_agents import CompressionConfig, GenerationSettings, PooledAgent, SharedKVPool, load_model
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.chat.messages import to_chat_messages
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.registry import PoolRegistry
from polykv_agents.pool.store import PoolStore
from polykv_agents.prompting.encode import encode_prompt
from polykv_agents.runtime.scheduler import BatchScheduler

DOC = "Shared caches let many agents read one document. " * 4
QUESTION = "What do agents share?"
MESSAGES = [SystemMessage("You are the critic."), HumanMessage(QUESTION)]


def other_tokenizer():
    """The tiny tokenizer plus one added token: same model, another vocabulary."""
    tokenizer = tiny_tokenizer.__wrapped__()  # a fresh copy, not the cached shared one
    tokenizer.add_tokens(["<extra-token>"])
    return tokenizer


@pytest.fixture(scope="module")
def pool(tiny_model, tiny_tok) -> SharedKVPool:
    return SharedKVPool.prefill(tiny_model, tiny_tok, DOC)


@pytest.fixture
def chat(tiny_model_dir) -> ChatPolyKV:
    return ChatPolyKV(model=tiny_model_dir, max_tokens=12)


@pytest.fixture
def chat_pool(tiny_model_dir) -> SharedKVPool:
    """A chat-prefix pool built with the very model the chat model loads."""
    model, tokenizer = load_model(tiny_model_dir)
    return SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": DOC}])


# ---------------------------------------------------------------- documents


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ("", "empty or only whitespace; pass the text"),
        (" \n\t ", "empty or only whitespace; pass the text"),
        (b"\xff\xfe not utf-8", "not valid UTF-8.*convert it to UTF-8"),
        (b"   ", "empty or only whitespace"),
    ],
    ids=["empty", "whitespace", "invalid-utf8-bytes", "whitespace-bytes"],
)
def test_empty_and_undecodable_documents_say_what_to_pass(tiny_model, tiny_tok, document, fragment):
    """test_pool accepts either message for every case; here each case must get its own advice."""
    with pytest.raises(ValueError, match=fragment):
        SharedKVPool.prefill(tiny_model, tiny_tok, document)


def test_valid_utf8_bytes_give_the_same_pool_as_the_text(tiny_model, tiny_tok):
    text = "Caf\u00e9 agents share one document. " * 3
    assert SharedKVPool.prefill(tiny_model, tiny_tok, text.encode()).digest == (
        SharedKVPool.prefill(tiny_model, tiny_tok, text).digest
    )


def test_a_one_token_document_is_continued_exactly(tiny_model, tiny_tok, tmp_path):
    """The smallest pool: per-channel scales and rotations over a single token must still work, and a
    full-precision pool must give exactly the tokens of a plain forward over document + prompt."""
    assert tiny_tok("q", add_special_tokens=True).input_ids == [tiny_tok.convert_tokens_to_ids("q")]
    full = SharedKVPool.prefill(tiny_model, tiny_tok, "q", config=CompressionConfig.full_precision())
    assert full.num_tokens == 1
    agent = PooledAgent(full, tiny_model, tiny_tok)
    pooled = list(agent.generate_ids(QUESTION, GenerationSettings(max_new_tokens=8)))
    ids = torch.cat([full.token_ids, agent.prompt_ids(QUESTION)]).unsqueeze(0)
    out = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    reference = out[0, ids.shape[-1] :].tolist()
    eos = tiny_model.generation_config.eos_token_id
    assert pooled == (reference[: reference.index(eos)] if eos in reference else reference)

    for config in (CompressionConfig(), CompressionConfig.paper(), CompressionConfig.max_compression()):
        compressed = SharedKVPool.prefill(tiny_model, tiny_tok, "q", config=config)
        keys, values = compressed.decompress_layer(0)
        assert keys.shape[-2] == 1 and torch.isfinite(keys).all() and torch.isfinite(values).all()
        store = PoolStore(tmp_path)
        store.save(compressed)
        assert store.load(compressed.digest).tensor_checksum() == compressed.tensor_checksum()


def test_a_document_that_fills_every_position_is_refused_and_one_token_less_leaves_no_room(tiny_model, tiny_tok):
    """The tiny Llama has 1024 positions; "q" is one token, and no merge joins two of them."""
    assert len(tiny_tok("q" * 1024).input_ids) == 1024
    with pytest.raises(ValueError, match=r"1024 tokens, but the model covers at most 1024 positions.*shorten or split"):
        SharedKVPool.prefill(tiny_model, tiny_tok, "q" * 1024)
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, "q" * 1023)  # fits, but nothing fits after it
    with pytest.raises(ValueError, match=r"exceeds the model's 1024 positions; use a shorter document or prompt"):
        PooledAgent(pool, tiny_model, tiny_tok).generate(QUESTION)


def test_perplexity_beyond_the_models_positions_is_refused(tiny_model, tiny_tok):
    from polykv_agents.eval.perplexity import perplexity_deltas

    with pytest.raises(ValueError, match="positions"):
        perplexity_deltas(
            tiny_model,
            tiny_tok,
            "q" * 1200,
            context_tokens=1000,
            continuation_tokens=100,  # 1100 > the tiny Llama's 1024 positions
            configs=[CompressionConfig()],
        )


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("config", ["paper", {"keys": {"method": "int"}}], ids=["preset-name", "plain-dict"])
def test_a_config_that_is_not_a_compression_config_is_a_clear_error(tiny_model, tiny_tok, config):
    with pytest.raises(TypeError, match=r"config must be a CompressionConfig.*pass CompressionConfig"):
        SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=config)


def test_chat_max_tokens_zero_gives_an_empty_answer_without_decoding(chat, chat_pool):
    pooled = chat.with_pool(chat_pool).bind(max_tokens=0)
    message = pooled.invoke(MESSAGES)
    assert message.content == ""
    assert message.response_metadata["finish_reason"] == "length"
    assert message.usage_metadata["output_tokens"] == 0
    assert "".join(c.content for c in pooled.stream(MESSAGES)) == ""


def test_chat_stop_strings_that_never_occur_change_nothing(chat, chat_pool):
    pooled = chat.with_pool(chat_pool)
    free = pooled.invoke(MESSAGES)
    stopped = pooled.invoke(MESSAGES, stop=["never occurs \u2603", "nor this"])
    assert stopped.content == free.content
    assert stopped.response_metadata["finish_reason"] == free.response_metadata["finish_reason"] == "length"


def test_agent_stop_string_at_the_start_of_the_answer_gives_an_empty_answer(pool, tiny_model, tiny_tok):
    agent = PooledAgent(pool, tiny_model, tiny_tok)
    free = agent.generate(QUESTION, max_new_tokens=20)
    assert len(free) >= 2
    assert agent.generate(QUESTION, max_new_tokens=20, stop=[free[:2]]) == ""
    assert list(agent.stream(QUESTION, max_new_tokens=20, stop=free[:2])) == []


def test_chat_stop_string_at_the_start_of_the_answer_gives_an_empty_answer(chat, chat_pool):
    pooled = chat.with_pool(chat_pool)
    free = pooled.invoke(MESSAGES).content
    assert len(free) >= 2
    message = pooled.invoke(MESSAGES, stop=[free[:2]])
    assert message.content == ""
    assert message.response_metadata["finish_reason"] == "stop"
    assert "".join(c.content for c in pooled.stream(MESSAGES, stop=[free[:2]])) == ""


# ---------------------------------------------------------------- pools and models


def test_agent_refuses_a_pool_built_with_another_tokenizer(pool, tiny_model):
    with pytest.raises(ValueError, match=r"tokenizer_sha.*Build a new pool with this model"):
        PooledAgent(pool, tiny_model, other_tokenizer())


def test_registry_resolve_refuses_another_tokenizer(tiny_model, tiny_tok):
    registry = PoolRegistry()
    handle = PoolHandle.from_pool(registry.get_or_build(tiny_model, tiny_tok, DOC))
    with pytest.raises(ValueError, match=r"tokenizer_sha.*Build a new pool with this model"):
        registry.resolve(handle, tiny_model, other_tokenizer(), document=DOC)
    assert registry.build_count == 1  # refused before any rebuild


def test_chat_model_refuses_a_handle_to_a_pool_of_another_model(chat, tiny_tok):
    foreign = SharedKVPool.prefill(tiny_llama(seed=1), tiny_tok, [{"role": "user", "content": DOC}])
    with pytest.raises(ValueError, match=r"weights_sha.*Build a new pool with this model"):
        chat.with_pool(PoolHandle.from_pool(foreign), document=[{"role": "user", "content": DOC}]).invoke(MESSAGES)


def test_chat_model_refuses_a_handle_to_a_pool_of_another_tokenizer(tiny_model, tiny_tok, tmp_path):
    """Same weights, a tokenizer with one more token: the chat model's checkpoint differs only there."""
    tiny_model.save_pretrained(tmp_path)
    other_tokenizer().save_pretrained(tmp_path)
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, [{"role": "user", "content": DOC}])
    chat = ChatPolyKV(model=str(tmp_path), max_tokens=4).with_pool(PoolHandle.from_pool(pool))
    with pytest.raises(ValueError, match=r"tokenizer_sha.*Build a new pool with this model"):
        chat.invoke(MESSAGES)


def test_mismatch_message_names_a_model_that_has_no_path(pool, tiny_tok):
    with pytest.raises(ValueError) as info:
        PooledAgent(pool, tiny_llama(seed=1), tiny_tok)
    assert "cannot be read with ''" not in str(info.value)


def test_a_handle_forged_past_validation_cannot_leave_the_store(pool, tiny_model, tiny_tok, tmp_path):
    """PoolHandle validates its digest, but model_copy skips validation; the store checks again."""
    handle = PoolHandle.from_pool(pool, store_dir=tmp_path).model_copy(update={"digest": "../../etc/passwd"})
    with pytest.raises(ValueError, match="64 lowercase hexadecimal"):
        PoolRegistry().resolve(handle, tiny_model, tiny_tok)


# ---------------------------------------------------------------- messages


def test_a_conversation_ending_with_an_ai_message_continues_that_message(chat, chat_pool, tiny_tok):
    """Assistant prefill: the prompt ends inside the AI message and the model writes the rest of it;
    the returned message holds only the continuation."""
    ending_with_ai = [*MESSAGES, AIMessage("Agents share")]
    ids = encode_prompt(tiny_tok, to_chat_messages(ending_with_ai), prefix_messages=chat_pool.prefix_messages)
    assert tiny_tok.decode(ids).endswith("<|im_start|>assistant\nAgents share")
    pooled = chat.with_pool(chat_pool)
    message = pooled.invoke(ending_with_ai)
    assert message.content != pooled.invoke(MESSAGES).content  # a continuation, not a fresh answer
    assert message.response_metadata["finish_reason"] in ("stop", "length")


def test_an_empty_final_ai_message_is_a_fresh_assistant_turn(chat_pool, tiny_tok):
    ids = encode_prompt(
        tiny_tok, to_chat_messages([*MESSAGES, AIMessage("")]), prefix_messages=chat_pool.prefix_messages
    )
    assert (
        ids.tolist()
        == encode_prompt(tiny_tok, to_chat_messages(MESSAGES), prefix_messages=chat_pool.prefix_messages).tolist()
    )


# ---------------------------------------------------------------- async cancellation


async def test_cancelling_one_astream_task_frees_its_row_and_others_get_their_solo_answers(
    chat, chat_pool, monkeypatch
):
    """Three concurrent streams share the pool's batched scheduler; one task is cancelled after its
    first chunk. The other two must get exactly the greedy answers they get alone, and the cancelled
    request must be ended by the scheduler ("stop") long before its token budget."""
    pooled = chat.with_pool(chat_pool)
    questions = {"a": "What do agents share?", "b": "Keys?", "victim": "Go on."}
    victim_tokens = 300
    solo = {name: pooled.invoke([HumanMessage(q)]).content for name, q in questions.items() if name != "victim"}
    # Without cancellation the victim decodes its whole budget (no EOS), so "stop" below can only come
    # from the cancellation reaching the scheduler.
    alone = pooled.bind(max_tokens=victim_tokens).invoke([HumanMessage(questions["victim"])])
    assert alone.response_metadata["finish_reason"] == "length"

    submitted = []  # (GenerationStats, budget) of every request, in submission order
    original_submit = BatchScheduler.submit

    def recording_submit(self, request, budget, *args, **kwargs):
        submitted.append((request.stats, budget))
        return original_submit(self, request, budget, *args, **kwargs)

    monkeypatch.setattr(BatchScheduler, "submit", recording_submit)

    started = {name: asyncio.Event() for name in questions}

    async def answer(name: str, max_tokens: int) -> str:
        pieces = []
        async for chunk in pooled.bind(max_tokens=max_tokens).astream([HumanMessage(questions[name])]):
            started[name].set()
            pieces.append(chunk.content)
        return "".join(pieces)

    victim_task = asyncio.create_task(answer("victim", victim_tokens))
    await started["victim"].wait()
    others = [asyncio.create_task(answer(name, chat.max_tokens)) for name in ("a", "b")]
    await asyncio.gather(started["a"].wait(), started["b"].wait())  # all three are mid-stream now
    victim_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim_task
    assert await asyncio.gather(*others) == [solo["a"], solo["b"]]

    victim_stats, victim_budget = next((s, b) for s, b in submitted if b == victim_tokens)
    deadline = time.monotonic() + 30  # a wait, not a timing assertion: the row ends at a step boundary
    while victim_stats.finish_reason is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert victim_stats.finish_reason == "stop"
    assert victim_stats.output_tokens < victim_budget
    # The scheduler keeps serving: a later request gets its solo answer.
    assert (await pooled.ainvoke([HumanMessage(questions["a"])])).content == solo["a"]
