"""ChatPolyKV glue on a tiny local checkpoint: usage metadata, streaming, stops, async, pools."""

from __future__ import annotations

import asyncio
import threading

import pytest
from langchain_core.messages import AIMessageChunk, FunctionMessage, HumanMessage, SystemMessage
from usage import pool_read

from polykv_agents import Engine, SharedKVPool, default_engine, load_model
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.model import loading as models_module
from polykv_agents.pool.handle import PoolHandle

DOC = "Shared caches let many agents read one document. Values use a rotated three-bit codebook. " * 6
MESSAGES = [SystemMessage("You are the critic."), HumanMessage("What do values use?")]


@pytest.fixture
def chat(tiny_model_dir) -> ChatPolyKV:
    return ChatPolyKV(model=tiny_model_dir, max_tokens=12)


@pytest.fixture
def pool(tiny_model_dir) -> SharedKVPool:
    model, tokenizer = load_model(tiny_model_dir)
    return SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": DOC}])


def test_constructing_loads_nothing(monkeypatch):
    monkeypatch.setattr(models_module, "load_model_uncached", lambda *a, **k: pytest.fail("a model was loaded"))
    ChatPolyKV(model="some/never-loaded-model", max_tokens=5).with_pool(
        PoolHandle.model_construct(digest="0" * 64)  # a handle is only resolved at call time
    )


def test_usage_reports_the_pool_tokens_as_cache_read(chat, pool):
    message = chat.with_pool(pool).invoke(MESSAGES)
    usage = message.usage_metadata
    assert usage["input_token_details"]["cache_read"] == pool.num_tokens
    assert usage["input_tokens"] > pool.num_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens"] <= 12
    assert message.response_metadata["pool_digest"] == pool.digest
    assert message.response_metadata["model_name"] == chat.model


def test_without_a_pool_it_is_a_plain_chat_model(chat):
    message = chat.invoke(MESSAGES)
    assert message.usage_metadata["input_token_details"]["cache_read"] == 0
    assert message.response_metadata["pool_digest"] is None


def test_pooled_call_equals_plain_call_over_the_whole_prompt(chat, tiny_model_dir):
    """A full-precision pool of a chat prefix + the role turns = the same conversation without a pool."""
    from polykv_agents import CompressionConfig

    model, tokenizer = load_model(tiny_model_dir)
    prefix = [{"role": "user", "content": DOC}]
    full = SharedKVPool.prefill(model, tokenizer, prefix, config=CompressionConfig.full_precision())
    pooled = chat.with_pool(full).invoke(MESSAGES).content
    plain = chat.invoke([HumanMessage(DOC), *MESSAGES]).content
    assert pooled == plain


def test_streaming_puts_usage_on_exactly_one_chunk_and_matches_invoke(chat, pool):
    pooled = chat.with_pool(pool)
    chunks = list(pooled.stream(MESSAGES))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    assert "".join(c.content for c in chunks) == pooled.invoke(MESSAGES).content


def test_multi_token_stop_sequences_work_streaming_and_not(chat, pool):
    pooled = chat.with_pool(pool).bind(max_tokens=40)
    free = pooled.invoke(MESSAGES).content
    stop = free[6:10]
    expected = free[: free.index(stop)]
    assert pooled.invoke(MESSAGES, stop=[stop]).content == expected
    assert "".join(c.content for c in pooled.stream(MESSAGES, stop=[stop])) == expected


def test_with_pool_registers_a_pool_object(chat, pool):
    bound = chat.with_pool(pool)
    assert bound.pool.digest == pool.digest and default_engine().pools.get(pool.digest) is pool
    assert chat.pool is None  # with_pool returns a copy


def test_unknown_message_types_are_a_clear_error(chat):
    with pytest.raises(TypeError, match="unsupported message type FunctionMessage"):
        chat.invoke([FunctionMessage(content="x", name="f")])


async def test_astream_does_not_block_the_event_loop(chat, pool):
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    pieces = [c.content async for c in chat.with_pool(pool).bind(max_tokens=30).astream(MESSAGES)]
    done.set()
    await task
    assert len(pieces) > 2
    assert ticks > len(pieces)  # the loop kept running while tokens were decoded on a worker thread


async def test_cancelling_a_stream_stops_its_decode_thread(chat, pool):
    before = {t.ident for t in threading.enumerate()}
    stream = chat.with_pool(pool).bind(max_tokens=200).astream(MESSAGES)
    await stream.__anext__()
    await stream.aclose()
    for _ in range(200):
        if not [t for t in threading.enumerate() if t.name == "polykv-decode" and t.ident not in before]:
            break
        await asyncio.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "polykv-decode" and t.ident not in before]


async def test_abatch_answers_each_input(chat, pool):
    results = await chat.with_pool(pool).abatch([[HumanMessage("One?")], [HumanMessage("Two?")]])
    assert len(results) == 2
    assert all(pool_read(r) == pool.num_tokens for r in results)


def test_a_critic_with_reuse_blocks_reads_the_quoted_finding_and_says_so(tiny_model_dir, pool):
    """reuse='blocks' through LangChain: the finding an earlier call wrote is read at its new position, counted in
    cache_read and in response_metadata['block_tokens']; the same call with reuse='exact' reads none of it."""
    engine = Engine(max_block_bytes=10**9)
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=12, engine=engine).with_pool(pool)
    finding = "Values use a rotated three-bit codebook, and keys use eight bits each. " * 2
    chat.invoke([HumanMessage("Write your finding: " + finding)])
    critic = [SystemMessage("You are the critic."), HumanMessage(f"The findings:\n1. {finding}\nWhich is weakest?")]
    blocks = chat.invoke(critic, reuse="blocks", block_recompute=0.0)
    exact = chat.invoke(critic)  # what the blocks call composed was never stored as exact: prefilled again
    assert exact.response_metadata["block_tokens"] == 0
    assert exact.response_metadata["reused_tokens"] < blocks.response_metadata["reused_tokens"]
    assert blocks.response_metadata["block_tokens"] >= 16
    cache_read = blocks.usage_metadata["input_token_details"]["cache_read"]
    assert cache_read == pool.num_tokens + blocks.response_metadata["reused_tokens"]
    assert blocks.response_metadata["reused_tokens"] >= blocks.response_metadata["block_tokens"]
    with pytest.raises(ValueError, match="block_recompute"):
        chat.invoke(critic, reuse="blocks", block_recompute=2.0)
    engine.close()
