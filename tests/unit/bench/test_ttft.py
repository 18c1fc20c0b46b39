"""What each time-to-first-token measurement includes: the prefix decode for cold, nothing but the
prompt for warm, the whole document for re-prefill."""

from __future__ import annotations

import pytest

from polykv_agents.agent import PooledAgent
from polykv_agents.bench import ttft
from polykv_agents.engine import Engine, default_engine
from polykv_agents.pool.shared_pool import SharedKVPool


@pytest.fixture
def pool(tiny_model, tiny_tok, sample_document):
    return SharedKVPool.prefill(tiny_model, tiny_tok, sample_document[:400])


@pytest.fixture
def decoded_layers(monkeypatch):
    """Counts the layers decoded from any pool's codes."""
    calls = []
    original = SharedKVPool.decompress_layer

    def counting(self, layer_idx, **kwargs):
        calls.append(layer_idx)
        return original(self, layer_idx, **kwargs)

    monkeypatch.setattr(SharedKVPool, "decompress_layer", counting)
    return calls


def test_cold_decodes_the_whole_prefix_inside_the_call_and_leaves_nothing_behind(
    pool, tiny_model, tiny_tok, decoded_layers
):
    schedulers_before = len(default_engine().schedulers)
    for _ in range(2):  # every cold call decodes again: nothing stays resident between them
        decoded_layers.clear()
        assert ttft.ttft_pool_cold(pool, tiny_model, tiny_tok, "You are an analyst.", "What is it about?") > 0
        assert sorted(decoded_layers) == list(range(pool.num_layers))
    assert len(default_engine().schedulers) == schedulers_before


def test_warm_times_a_call_that_finds_the_prefix_resident(pool, tiny_model, tiny_tok, decoded_layers, monkeypatch):
    engine = Engine(scheduler_idle_seconds=None)
    try:
        agent = PooledAgent(pool, tiny_model, tiny_tok, system_prompt="You are an analyst.", engine=engine)
        timed_calls = []
        original = ttft._first_token_seconds

        def recording(agent, question):
            decoded_before = len(decoded_layers)
            seconds = original(agent, question)
            timed_calls.append(len(decoded_layers) - decoded_before)
            return seconds

        monkeypatch.setattr(ttft, "_first_token_seconds", recording)
        assert ttft.ttft_pool_warm(agent, "What is it about?") > 0
    finally:
        engine.close()
    assert timed_calls == [pool.num_layers, 0]  # the untimed call decodes; the timed one finds it resident


def test_reprefill_prefills_document_and_prompt_together(pool, tiny_model, tiny_tok, monkeypatch):
    prefilled = []
    original = ttft.prefill_cache
    monkeypatch.setattr(ttft, "prefill_cache", lambda model, ids: prefilled.append(ids.numel()) or original(model, ids))
    agent = PooledAgent(pool, tiny_model, tiny_tok, system_prompt="You are an analyst.")
    prompt = agent.prompt_ids("What is it about?")
    assert ttft.ttft_reprefill(tiny_model, pool, prompt) > 0
    assert prefilled == [pool.num_tokens + prompt.numel()]


def test_time_to_first_token_stops_the_clock_at_the_first_token_and_drains_the_rest(monkeypatch):
    clock = iter([10.0, 12.5])  # the call, then the first token; draining the rest is not timed
    monkeypatch.setattr(ttft.time, "perf_counter", lambda: next(clock))
    drained = []

    def stream():
        yield 1
        drained.append(2)
        yield 2

    assert ttft.time_to_first_token(stream) == (10.0, 2.5)
    assert drained == [2]  # the call is over before the next measurement starts
    clock = iter([0.0, 0.25])
    assert ttft.time_to_first_token(lambda: iter(())) == (0.0, 0.25)  # an answer that ended at once


def test_a_chat_calls_reported_ttft_is_its_queue_and_prefill_seconds():
    from langchain_core.messages import AIMessage

    assert ttft.reported_ttft(AIMessage("a", response_metadata={"queue_s": 0.5, "prefill_s": 0.25})) == 0.75
    assert ttft.reported_ttft(AIMessage("a", response_metadata={"queue_s": None, "prefill_s": 0.25})) == 0.25
