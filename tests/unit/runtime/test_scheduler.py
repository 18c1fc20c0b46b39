"""The batched scheduler: concurrent agents get exactly their sequential greedy outputs.

The model is :func:`tiny_sensitive_llama`, whose answers depend strongly on the prompt, and every test that
compares several agents first checks that their expected answers differ: a row decoded from another row's
cache, rows joined in the wrong order, or a misplaced position then changes some answer."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import assert_pairwise_distinct, tiny_sensitive_llama

from polykv_agents import Engine, PooledAgent, SharedKVPool
from polykv_agents.runtime import scheduler_table
from polykv_agents.runtime.backend import PrivateBackend
from polykv_agents.runtime.generate import generate_token_ids
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler import BatchScheduler
from polykv_agents.sampling.settings import GenerationSettings

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 8
QUESTIONS = ["What do values use?", "Keys?", "Summarise the document in a few words, please."]
ROLES = ["planner", "critic", "summarizer", "fox", "dog", "keys", "values", "codebook"]
"""Role names whose one-word system prompts give the tiny model eight different answers."""


@pytest.fixture(scope="module")
def model():
    return tiny_sensitive_llama()


@pytest.fixture(scope="module")
def pool(model, tiny_tok):
    return SharedKVPool.prefill(model, tiny_tok, DOC)


def _prompt(pool, model, tok, i: int) -> torch.Tensor:
    """Role prompts of different lengths, so suffix lengths differ across rows."""
    agent = PooledAgent(pool, model, tok, system_prompt="You are agent " + "number " * i + str(i))
    return agent.prompt_ids(QUESTIONS[i % len(QUESTIONS)])


def _sequential(model, tok, pool, prompt, settings) -> list[int]:
    """The reference: one call alone, over a private copy of the decoded pool."""
    return list(generate_token_ids(DecodeRequest(model, tok, prompt, settings, pool=pool), PrivateBackend()))


def _submit(scheduler, prompt, settings):
    request = DecodeRequest(scheduler.model, scheduler._tokenizer, prompt, settings, pool=scheduler.prefix.pool)
    return scheduler.submit(request, settings.max_new_tokens), request.stats


def test_concurrent_requests_match_sequential_decoding(model, tiny_tok, pool):
    """Different suffix lengths, different stop steps (budgets), agents joining mid-flight."""
    scheduler = BatchScheduler(model, tiny_tok, pool)
    budgets = [30, 7, 18, 25, 3, 12]
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(len(budgets))]
    settings = [GenerationSettings(max_new_tokens=b) for b in budgets]
    expected = [_sequential(model, tiny_tok, pool, p, s) for p, s in zip(prompts, settings, strict=True)]
    assert_pairwise_distinct(expected)

    streams = [_submit(scheduler, prompts[i], settings[i])[0] for i in range(3)]
    got = [[next(stream) for _ in range(2)] for stream in streams]  # three agents are mid-flight ...
    late = [_submit(scheduler, prompts[i], settings[i])[0] for i in range(3, 6)]  # ... when three more join
    for i, stream in enumerate(streams):
        got[i] += list(stream)
    got += [list(stream) for stream in late]

    assert got == expected
    assert scheduler.peak_batch_size >= 4
    scheduler.close()


def test_each_agent_keeps_its_own_sampling_settings(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(3)]
    settings = [
        GenerationSettings(max_new_tokens=15),
        GenerationSettings(max_new_tokens=15, temperature=1.3, top_p=0.9, seed=11),
        GenerationSettings(max_new_tokens=15, temperature=0.7, seed=12),
    ]
    expected = [_sequential(model, tiny_tok, pool, p, s) for p, s in zip(prompts, settings, strict=True)]
    assert_pairwise_distinct(expected)
    streams = [_submit(scheduler, p, s)[0] for p, s in zip(prompts, settings, strict=True)]
    assert [list(s) for s in streams] == expected
    scheduler.close()


def test_cancelling_one_request_frees_its_row_and_leaves_the_others_unchanged(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(3)]
    settings = GenerationSettings(max_new_tokens=25)
    expected = [_sequential(model, tiny_tok, pool, p, settings) for p in prompts]
    assert_pairwise_distinct(expected)
    streams = [_submit(scheduler, p, settings) for p in prompts]
    first = [next(stream) for stream, _ in streams]
    cancelled, cancelled_stats = streams[1]
    cancelled.close()  # e.g. an asyncio task cancelled mid-stream
    rest = [first[i : i + 1] + list(streams[i][0]) for i in (0, 2)]
    assert rest == [expected[0], expected[2]]
    assert cancelled_stats.finish_reason == "stop"
    scheduler.close()


def test_threads_through_pooled_agents_get_their_sequential_answers(model, tiny_tok, pool):
    """The public path: PooledAgent calls from 8 threads share the pool's scheduler."""
    agents = [PooledAgent(pool, model, tiny_tok, system_prompt=f"Role {i}: {role}") for i, role in enumerate(ROLES)]
    settings = GenerationSettings(max_new_tokens=16)
    expected = [_sequential(model, tiny_tok, pool, a.prompt_ids("Go."), settings) for a in agents]
    assert_pairwise_distinct(expected)
    results: list[list[int] | None] = [None] * len(agents)

    def run(i: int) -> None:
        results[i] = list(agents[i].generate_ids("Go.", settings))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(agents))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == expected


def test_a_failed_step_reaches_the_caller_instead_of_hanging(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    bad_prompt = torch.tensor([10_000])  # out of the tiny vocabulary: the embedding lookup fails
    stream, _ = _submit(scheduler, bad_prompt, GenerationSettings(max_new_tokens=3))
    with pytest.raises(IndexError):
        list(stream)
    good = _prompt(pool, model, tiny_tok, 0)
    settings = GenerationSettings(max_new_tokens=5)
    assert list(_submit(scheduler, good, settings)[0]) == _sequential(model, tiny_tok, pool, good, settings)
    scheduler.close()


def test_an_idle_scheduler_retires_and_the_next_request_starts_a_fresh_one(model, tiny_tok, caplog, monkeypatch):
    """A long-lived process that reads many pools keeps only recently used schedulers (threads, decoded
    prefixes) alive, and hands the heap's free pages back when one retires; a request after retirement is served as
    before."""
    from polykv_agents.runtime import scheduler_table

    released = []
    monkeypatch.setattr(scheduler_table, "release_free_heap", lambda: released.append(1) or True)
    engine = Engine(scheduler_idle_seconds=0.6)
    pool = SharedKVPool.prefill(model, tiny_tok, "A document no other test reads, so no scheduler has it yet.")
    agent = PooledAgent(pool, model, tiny_tok, engine=engine)
    settings = GenerationSettings(max_new_tokens=6)
    with caplog.at_level(logging.DEBUG, logger="polykv_agents.runtime.scheduler_table"):
        first = list(agent.generate_ids("Go.", settings))
        retired = engine.schedulers.scheduler_for(model, tiny_tok, pool, "decompressed")
        retired._thread.join(timeout=10)  # its worker ends once idle for 0.6 s
    assert not retired._thread.is_alive()
    assert f"scheduler for pool {pool.digest[:12]} retired after 1 s idle" in caplog.messages
    assert released == [1]
    with pytest.raises(
        RuntimeError, match=r"this scheduler is closed; submit through a SchedulerTable \(an Engine's\)"
    ):
        retired.submit(DecodeRequest(model, tiny_tok, agent.prompt_ids("Go."), settings, pool=pool), 6)
    assert list(agent.generate_ids("Go.", settings)) == first
    assert engine.schedulers.scheduler_for(model, tiny_tok, pool, "decompressed") is not retired


def test_a_scheduler_with_work_never_retires(model, tiny_tok, monkeypatch, caplog):
    """Retirement is decided under the registry lock that submit() holds: an arriving request keeps it."""
    pool = SharedKVPool.prefill(model, tiny_tok, "Another document of its own, so every scheduler here is counted.")
    created = []

    class Counted(BatchScheduler):
        def __init__(self, *args, **kwargs) -> None:
            created.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(scheduler_table, "BatchScheduler", Counted)
    engine = Engine(scheduler_idle_seconds=0.0)  # retire the moment there is no work
    agents = [
        PooledAgent(pool, model, tiny_tok, system_prompt=f"Role {i}: {role}", engine=engine)
        for i, role in enumerate(ROLES[:4])
    ]
    settings = GenerationSettings(max_new_tokens=8)
    expected = [_sequential(model, tiny_tok, pool, a.prompt_ids("Go."), settings) for a in agents]
    assert_pairwise_distinct(expected)
    with caplog.at_level(logging.DEBUG, logger="polykv_agents.runtime.scheduler_table"):
        for _ in range(5):  # schedulers retire between rounds all the time; no request is ever lost
            with ThreadPoolExecutor(4) as executor:
                assert list(executor.map(lambda a: list(a.generate_ids("Go.", settings)), agents)) == expected
    assert len(created) >= 2  # retirement really happened in between
    assert any(message.endswith("retired after 0 s idle") for message in caplog.messages)


def test_a_row_that_ends_at_its_first_token_leaves_the_rows_admitted_with_it_unchanged(model, tiny_tok, pool):
    """Four requests admitted in ONE forward: one may make a single token, one none at all. Their rows leave at
    admission and the rows after them must keep their own caches."""
    scheduler = BatchScheduler(model, tiny_tok, pool)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(4)]
    settings = [GenerationSettings(max_new_tokens=n) for n in (10, 1, 0, 10)]
    expected = [_sequential(model, tiny_tok, pool, p, s) for p, s in zip(prompts, settings, strict=True)]
    assert [len(tokens) for tokens in expected] == [10, 1, 0, 10]
    assert_pairwise_distinct(expected)
    with scheduler._wake:  # held: the worker sees all four requests at once
        submitted = [_submit(scheduler, p, s) for p, s in zip(prompts, settings, strict=True)]
    assert [list(stream) for stream, _ in submitted] == expected
    assert [stats.finish_reason for _, stats in submitted] == ["length"] * 4
    assert scheduler.peak_batch_size == 2
    scheduler.close()


def test_requests_beyond_max_batch_size_wait_for_a_free_row(model, tiny_tok, pool):
    """Also over a prefix kept compressed: the scheduler reads the pool and holds no decoded prefix."""
    scheduler = BatchScheduler(model, tiny_tok, pool, residency="compressed", max_batch_size=2)
    assert scheduler.prefix.layers() == () and scheduler.prefix.resident_nbytes < pool.nbytes
    assert (scheduler.peak_batch_size, scheduler.peak_suffix_nbytes) == (0, 0)
    # A named daemon thread: it shows in thread dumps, and never keeps the interpreter from exiting.
    assert (scheduler._thread.name, scheduler._thread.daemon) == ("polykv-scheduler", True)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(4)]
    settings = [GenerationSettings(max_new_tokens=n) for n in (4, 9, 6, 3)]
    expected = [_sequential(model, tiny_tok, pool, p, s) for p, s in zip(prompts, settings, strict=True)]
    assert_pairwise_distinct(expected)
    with scheduler._wake:
        streams = [_submit(scheduler, p, s)[0] for p, s in zip(prompts, settings, strict=True)]
    assert [list(stream) for stream in streams] == expected
    assert scheduler.peak_batch_size == 2
    assert scheduler.peak_suffix_nbytes > 0
    scheduler.close()
    assert not scheduler._thread.is_alive()  # close() waits for the worker


class _BrokenGrammar:
    """A grammar state that fails as soon as it is asked anything."""

    def __getattr__(self, name: str):
        msg = f"broken grammar: {name}"
        raise RuntimeError(msg)


def test_a_failing_grammar_ends_only_its_own_row(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(2)]
    settings = GenerationSettings(max_new_tokens=8)
    expected = _sequential(model, tiny_tok, pool, prompts[1], settings)
    broken = DecodeRequest(model, tiny_tok, prompts[0], settings, pool=pool)
    with scheduler._wake:
        failing = scheduler.submit(broken, 8, _BrokenGrammar())
        healthy, _ = _submit(scheduler, prompts[1], settings)
    with pytest.raises(RuntimeError, match="broken grammar"):
        list(failing)
    assert broken.stats.finish_reason == "stop"
    assert list(healthy) == expected
    scheduler.close()


def test_a_row_that_reaches_eos_ends_with_reason_stop_and_the_others_go_on(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(2)]
    settings = GenerationSettings(max_new_tokens=10)
    expected = [_sequential(model, tiny_tok, pool, p, settings) for p in prompts]
    eos = expected[0][4]  # the first row's fifth token stands in for EOS here
    scheduler._eos_ids = frozenset({eos})
    with scheduler._wake:
        submitted = [_submit(scheduler, p, settings) for p in prompts]
    ends = [tokens.index(eos) if eos in tokens else None for tokens in expected]
    assert ends[0] == 4
    assert [list(stream) for stream, _ in submitted] == [
        tokens[:end] for tokens, end in zip(expected, ends, strict=True)
    ]
    assert [stats.finish_reason for _, stats in submitted] == ["length" if end is None else "stop" for end in ends]
    scheduler.close()


def test_a_failed_decode_step_reaches_every_running_row_and_the_next_request_starts_clean(
    model, tiny_tok, pool, caplog
):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    decode_step = scheduler._decode_step
    failures = []

    def fail_once() -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("decode step failed on purpose")
        decode_step()

    scheduler._decode_step = fail_once
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(3)]
    settings = GenerationSettings(max_new_tokens=6)
    expected = [_sequential(model, tiny_tok, pool, p, settings) for p in prompts]
    assert_pairwise_distinct(expected)
    with caplog.at_level(logging.ERROR, logger="polykv_agents.runtime.scheduler"), scheduler._wake:
        streams = [_submit(scheduler, p, settings)[0] for p in prompts[:2]]
    for stream in streams:
        with pytest.raises(RuntimeError, match="on purpose"):
            list(stream)
    assert "batched decode step failed" in caplog.messages
    assert list(_submit(scheduler, prompts[2], settings)[0]) == expected[2]  # over an emptied batch
    scheduler.close()


def test_closing_ends_running_and_waiting_requests_with_reason_stop(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool, max_batch_size=1)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(2)]
    settings = GenerationSettings(max_new_tokens=500)
    running, running_stats = _submit(scheduler, prompts[0], settings)
    next(running)
    waiting, waiting_stats = _submit(scheduler, prompts[1], settings)  # no free row: it waits
    scheduler.close()
    assert len(list(running)) < 499
    assert list(waiting) == []
    assert (running_stats.finish_reason, waiting_stats.finish_reason) == ("stop", "stop")


def test_a_scheduler_told_never_to_retire_outlives_its_idle_time(model, tiny_tok):
    """Benchmarks that read peaks set ``idle_seconds = None`` on a live scheduler: it must then stay."""
    engine = Engine(scheduler_idle_seconds=0.2)
    pool = SharedKVPool.prefill(model, tiny_tok, "A document of this test alone, read by a scheduler that stays.")
    scheduler = engine.schedulers.scheduler_for(model, tiny_tok, pool, "decompressed")
    scheduler.idle_seconds = None  # its worker is already waiting with the 0.2 s timeout
    scheduler._thread.join(timeout=1.0)
    assert scheduler._thread.is_alive()
    assert engine.schedulers.scheduler_for(model, tiny_tok, pool, "decompressed") is scheduler
    engine.close()


def _record_forwards(model) -> list[tuple[int, int]]:
    """``(rows, tokens)`` of ``input_ids`` of every forward of ``model`` from now on, in order."""
    forwards: list[tuple[int, int]] = []

    def record(_module, _args, kwargs):
        forwards.append(tuple(kwargs["input_ids"].shape))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return forwards


@pytest.mark.parametrize("packed", [True, False], ids=["one-forward-per-step", "two-forwards-per-step"])
def test_a_long_prompt_is_admitted_in_chunks_between_the_running_row_s_steps(packed, tiny_tok, pool):
    """While a row decodes, a newly admitted prompt goes in chunks of ``admission_chunk_tokens``, one per step,
    each step also decoding the running row: in the same forward (packed, the flat ``[1, 1 + 4]``) or in a
    forward of its own right after. That row never waits for the whole prompt, and both rows still get exactly
    their sequential answers."""
    model = tiny_sensitive_llama()  # its own: the hook stays on it
    scheduler = BatchScheduler(model, tiny_tok, pool, admission_chunk_tokens=4, pack_admissions=packed)
    short, long = _prompt(pool, model, tiny_tok, 0), _prompt(pool, model, tiny_tok, 6)
    running, joining = GenerationSettings(max_new_tokens=40), GenerationSettings(max_new_tokens=5)
    expected = [_sequential(model, tiny_tok, pool, short, running), _sequential(model, tiny_tok, pool, long, joining)]
    assert_pairwise_distinct(expected)
    forwards = _record_forwards(model)

    first, _ = _submit(scheduler, short, running)
    got_first = [next(first) for _ in range(2)]  # one row is decoding ...
    second, _ = _submit(scheduler, long, joining)  # ... when a long prompt arrives
    got_second = list(second)
    got_first += list(first)
    scheduler.close()

    assert [got_first, got_second] == expected
    assert forwards[0] == (1, short.numel())  # nothing was running: the first prompt went in whole
    n_chunks = -(-long.numel() // 4)
    if packed:
        chunks = [shape for shape in forwards if shape[0] == 1 and shape[1] > 1][1:]
        assert chunks[:-1] == [(1, 1 + 4)] * (n_chunks - 1)
        assert chunks[-1] == (1, 1 + long.numel() - 4 * (n_chunks - 1))
        assert (1, 4) not in forwards
    else:
        chunks = [i for i, (rows, width) in enumerate(forwards) if i > 0 and width > 1]
        assert len(chunks) == n_chunks and all(forwards[i] == (1, 4) for i in chunks[:-1])
        assert all(forwards[i + 1] == (1, 1) for i in chunks[:-1])  # the running row's step after every chunk


def test_without_chunking_an_admission_is_one_forward(tiny_tok, pool):
    """The whole prompt in one forward of its own (a whole admission is never packed with the running rows)."""
    model = tiny_sensitive_llama()
    scheduler = BatchScheduler(model, tiny_tok, pool, admission_chunk_tokens=None)
    forwards = _record_forwards(model)
    short, long = _prompt(pool, model, tiny_tok, 0), _prompt(pool, model, tiny_tok, 6)
    first, _ = _submit(scheduler, short, GenerationSettings(max_new_tokens=20))
    next(first)
    second, _ = _submit(scheduler, long, GenerationSettings(max_new_tokens=3))
    list(second), list(first)
    scheduler.close()
    assert (1, long.numel()) in forwards
    with pytest.raises(ValueError, match="admission_chunk_tokens must be at least 1 or None"):
        BatchScheduler(model, tiny_tok, pool, admission_chunk_tokens=0)
