"""Steps shared across pools (:mod:`polykv_agents.runtime.model_steps`): calls over different documents go through
the model in one forward, and each still decodes exactly its tokens alone.

Every test that compares calls first checks that their expected answers differ, so a row attending to another
pool's prefix, logits handed to the wrong pool, or a misplaced position changes some answer."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import FAMILIES, SLIDING_WINDOW, assert_pairwise_distinct, tiny_causal_lm, tiny_gemma3

from polykv_agents import PooledAgent, SharedKVPool
from polykv_agents.config import CompressionConfig
from polykv_agents.runtime.backend import PrivateBackend
from polykv_agents.runtime.generate import generate_token_ids
from polykv_agents.runtime.model_steps import ModelSteps
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler import BatchScheduler
from polykv_agents.sampling.settings import GenerationSettings

DOCUMENTS = (
    "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 2,
    "The planner splits the review into parts, the critic checks every claim against the text. " * 4,
    "A pool is prefilled once and read by every agent; nothing is copied per agent. " * 7,
)
"""Three documents of different lengths: their pools' prefixes differ in length and content."""
QUESTIONS = ("What do values use?", "Keys?", "Summarise the document in a few words, please.", "Who checks?")


def _pools(model, tok) -> list[SharedKVPool]:
    config = CompressionConfig.full_precision()  # exactness of the step, not of the codec
    return [SharedKVPool.prefill(model, tok, document, config=config) for document in DOCUMENTS]


def _prompt(pool, model, tok, i: int) -> torch.Tensor:
    agent = PooledAgent(pool, model, tok, system_prompt="You are agent " + "number " * (i % 3) + str(i))
    return agent.prompt_ids(QUESTIONS[i % len(QUESTIONS)])


def _alone(model, tok, pool, prompt, settings) -> list[int]:
    """The reference: one call alone, over a private copy of its decoded pool."""
    return list(generate_token_ids(DecodeRequest(model, tok, prompt, settings, pool=pool), PrivateBackend()))


def _submit(scheduler, prompt, settings, constraint=None):
    request = DecodeRequest(scheduler.model, scheduler._tokenizer, prompt, settings, pool=scheduler.prefix.pool)
    return scheduler.submit(request, settings.max_new_tokens, constraint)


def _schedulers(model, tok, pools, steps, **kwargs) -> list[BatchScheduler]:
    return [BatchScheduler(model, tok, pool, steps=steps, **kwargs) for pool in pools]


def _calls(model, tok, pools) -> list[tuple[int, torch.Tensor, GenerationSettings]]:
    """Two calls per pool, with different budgets: (pool index, prompt, settings)."""
    budgets = (14, 6, 11, 9, 16, 4)
    return [
        (
            i % len(pools),
            _prompt(pools[i % len(pools)], model, tok, i),
            GenerationSettings(max_new_tokens=b, ignore_eos=True),
        )
        for i, b in enumerate(budgets)
    ]


def _submitted_together(schedulers, calls, extra=()) -> list:
    """Each call's token stream (and those of ``extra``, ``(pool index, prompt, settings, constraint)``), all
    submitted under every scheduler's lock: every pool has work before any takes a step."""
    for scheduler in schedulers:
        scheduler._wake.acquire()
    try:
        streams = [_submit(schedulers[p], prompt, settings) for p, prompt, settings in calls]
        return streams + [_submit(schedulers[p], prompt, settings, c) for p, prompt, settings, c in extra]
    finally:
        for scheduler in schedulers:
            scheduler._wake.release()


def _run_together(schedulers, calls) -> list[list[int]]:
    return [list(stream) for stream in _submitted_together(schedulers, calls)]


def _three_schedulers(tok):
    """Calls over three pools of the first family, their answers alone, and one scheduler per pool sharing steps."""
    model = tiny_causal_lm(FAMILIES[0])
    pools = _pools(model, tok)
    calls = _calls(model, tok, pools)
    expected = [_alone(model, tok, pools[p], prompt, settings) for p, prompt, settings in calls]
    steps = ModelSteps(gather_seconds=0.5)
    return calls, expected, steps, _schedulers(model, tok, pools, steps)


def _check_together(model, tok, pools, **kwargs) -> ModelSteps:
    calls = _calls(model, tok, pools)
    expected = [_alone(model, tok, pools[p], prompt, settings) for p, prompt, settings in calls]
    assert_pairwise_distinct(expected)
    steps = ModelSteps(gather_seconds=0.5)  # generous: the test asserts that steps were shared
    schedulers = _schedulers(model, tok, pools, steps, **kwargs)
    assert _run_together(schedulers, calls) == expected
    for scheduler in schedulers:
        scheduler.close()
    assert steps.shared_steps > 0 and steps.peak_pools_per_step == len(pools)
    return steps


@pytest.mark.parametrize("family", FAMILIES)
def test_calls_over_three_pools_share_forwards_and_decode_exactly_their_tokens_alone(family, tiny_tok, attention_path):
    model = tiny_causal_lm(family)
    _check_together(model, tiny_tok, _pools(model, tiny_tok))


def test_sliding_window_layers_of_gemma3_see_their_own_pool_past_the_window(tiny_tok):
    model = tiny_gemma3()
    pools = _pools(model, tiny_tok)
    assert min(pool.num_tokens for pool in pools) > SLIDING_WINDOW  # every row attends past the window
    _check_together(model, tiny_tok, pools)


def test_compressed_residency_is_shared_too(tiny_tok):
    model = tiny_causal_lm(FAMILIES[0])
    _check_together(model, tiny_tok, _pools(model, tiny_tok), residency="compressed")


def test_admissions_in_chunks_share_the_steps_of_other_pools_running_rows(tiny_tok):
    """A small chunk budget: each admission goes in over several steps, packed with the other pools' rows."""
    model = tiny_causal_lm(FAMILIES[0])
    _check_together(model, tiny_tok, _pools(model, tiny_tok), admission_chunk_tokens=8)


class _BrokenGrammar:
    """A grammar state that fails as soon as it is asked anything."""

    def __getattr__(self, name: str):
        msg = f"broken grammar: {name}"
        raise RuntimeError(msg)


def test_a_failing_grammar_and_a_cancelled_call_end_only_their_own_rows(tiny_tok):
    calls, expected, steps, schedulers = _three_schedulers(tiny_tok)
    *streams, broken = _submitted_together(schedulers, calls, [(1, calls[1][1], calls[1][2], _BrokenGrammar())])
    cancelled = streams[0]
    first = [next(cancelled) for _ in range(3)]
    cancelled.close()  # what a stop sequence does: its consumer closes the stream
    with pytest.raises(RuntimeError, match="broken grammar"):
        list(broken)
    got = [list(stream) for stream in streams[1:]]
    assert first == expected[0][:3]
    assert got == expected[1:]
    for scheduler in schedulers:
        scheduler.close()
    assert steps.shared_steps > 0


def test_a_pool_whose_forward_fails_fails_only_its_own_rows(tiny_tok, caplog):
    """The shared forward fails; each pool runs its step alone, and only the broken pool's rows get the error."""
    calls, expected, steps, schedulers = _three_schedulers(tiny_tok)
    broken = schedulers[2].prefix

    def fail(layer_idx: int):
        msg = "this pool's prefix is broken"
        raise RuntimeError(msg)

    broken.layer = fail
    with caplog.at_level(logging.WARNING, logger="polykv_agents.runtime.model_steps"):
        streams = _submitted_together(schedulers, calls)
        for (p, _, _), stream, tokens in zip(calls, streams, expected, strict=True):
            if p == 2:
                with pytest.raises(RuntimeError, match="prefix is broken"):
                    list(stream)
            else:
                assert list(stream) == tokens
    for scheduler in schedulers:
        scheduler.close()
    assert steps.shared_steps > 0  # the two healthy pools went on sharing their steps
    assert any("each runs its step alone" in message for message in caplog.messages)


def _drained(stream, seconds: float = 60.0) -> list[int] | BaseException:
    """A stream's tokens, or the error it raised; a stream that hangs fails the test instead of hanging it."""
    import threading

    result: list = []

    def drain() -> None:
        try:
            result.append(list(stream))
        except Exception as e:  # the error is what the test compares
            result.append(e)

    thread = threading.Thread(target=drain, daemon=True)  # daemon: a hung stream cannot hold pytest's exit
    thread.start()
    thread.join(seconds)
    if not result:
        pytest.fail("a call waited for ever")
    return result[0]


def test_a_pool_whose_admission_cannot_be_prepared_fails_only_its_own_calls(tiny_tok):
    """Calls taken from a pool's inbox for an admission that fails to prepare end with the error; none waits."""
    calls, expected, steps, schedulers = _three_schedulers(tiny_tok)

    def fail(request):
        msg = "this pool's prefix tree is broken"
        raise RuntimeError(msg)

    schedulers[0]._reuse.start = fail
    streams = _submitted_together(schedulers, calls)
    for (p, _, _), stream, tokens in zip(calls, streams, expected, strict=True):
        got = _drained(stream)
        if p == 0:
            assert isinstance(got, RuntimeError) and "prefix tree is broken" in str(got)
        else:
            assert got == tokens
    for scheduler in schedulers:
        scheduler.close()
    assert steps.shared_steps > 0


def test_an_unforeseen_failure_of_a_shared_step_ends_every_call_in_it(tiny_tok, caplog):
    """A failure outside the shared forward (here the gathering itself) cannot be pinned on one pool: every call
    of the step gets the error, and none waits for ever."""
    calls, _, steps, schedulers = _three_schedulers(tiny_tok)

    def fail(batch):
        msg = "the step itself is broken"
        raise RuntimeError(msg)

    steps._shared_step = fail
    with caplog.at_level(logging.ERROR, logger="polykv_agents.runtime.model_steps"):
        for stream in _submitted_together(schedulers, calls):
            got = _drained(stream)
            assert isinstance(got, RuntimeError) and "step itself is broken" in str(got)
    for scheduler in schedulers:
        scheduler.close()
    assert any("outside its forward" in message for message in caplog.messages)


def test_one_pool_alone_runs_its_own_step_and_shares_nothing(tiny_tok):
    model = tiny_causal_lm(FAMILIES[0])
    pool = _pools(model, tiny_tok)[0]
    steps = ModelSteps()
    (scheduler,) = _schedulers(model, tiny_tok, [pool], steps)
    settings = GenerationSettings(max_new_tokens=8)
    prompt = _prompt(pool, model, tiny_tok, 0)
    assert list(_submit(scheduler, prompt, settings)) == _alone(model, tiny_tok, pool, prompt, settings)
    scheduler.close()
    assert steps.shared_steps == 0


def test_an_engine_shares_steps_across_the_pools_of_one_model(tiny_tok):
    """Through the public API: agents over three documents, called from threads, on one engine."""
    from concurrent.futures import ThreadPoolExecutor

    from polykv_agents import Engine

    model = tiny_causal_lm(FAMILIES[0])
    pools = _pools(model, tiny_tok)
    engine = Engine()
    engine.schedulers.steps_for(model).gather_seconds = 0.5
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    agents = [PooledAgent(pool, model, tiny_tok, system_prompt=f"Agent {i}", engine=engine) for i, pool in
              enumerate(pools)]  # fmt: skip
    questions = QUESTIONS[: len(agents)]
    expected = [
        _alone(model, tiny_tok, agent.pool, agent.prompt_ids(q), settings)
        for agent, q in zip(agents, questions, strict=True)
    ]
    assert_pairwise_distinct(expected)
    with ThreadPoolExecutor(len(agents)) as threads:
        pairs = zip(agents, questions, strict=True)
        got = list(threads.map(lambda pair: list(pair[0].generate_ids(pair[1], settings)), pairs))
    assert got == expected
    assert engine.schedulers.steps_for(model).peak_pools_per_step >= 2
    engine.close()


def test_a_full_engine_makes_a_call_wait_then_refuses_it_saying_what_to_raise(tiny_tok):
    from polykv_agents import Engine, EngineBusyError

    model = tiny_causal_lm(FAMILIES[0])
    pool = _pools(model, tiny_tok)[0]
    engine = Engine(max_calls=2, call_wait_seconds=0.2)
    backend = engine.backend("decompressed")
    long = GenerationSettings(max_new_tokens=10_000, ignore_eos=True)
    prompts = [_prompt(pool, model, tiny_tok, i) for i in range(3)]
    running = [generate_token_ids(DecodeRequest(model, tiny_tok, p, long, pool=pool), backend) for p in prompts[:2]]
    for tokens in running:
        next(tokens)  # both hold their places
    with pytest.raises(EngineBusyError, match=r"serving 2 calls \(its max_calls\).*raise Engine\(max_calls="):
        next(generate_token_ids(DecodeRequest(model, tiny_tok, prompts[2], long, pool=pool), backend))
    running[0].close()  # a call that ends frees its place: the next one is served
    short = GenerationSettings(max_new_tokens=4)
    answer = list(generate_token_ids(DecodeRequest(model, tiny_tok, prompts[2], short, pool=pool), backend))
    assert answer == _alone(model, tiny_tok, pool, prompts[2], short)
    running[1].close()
    engine.close()
