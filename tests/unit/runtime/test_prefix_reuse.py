"""Exact reuse of what earlier calls over a pool ran through the model: a call whose prompt extends an earlier
call's tokens prefills only its new tokens, and decodes exactly what a full prefill would.

The model is :func:`tiny_sensitive_llama` (answers depend strongly on the prompt) for the scheduler's cases, and
every tiny family for exactness."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import FAMILIES, SLIDING_WINDOW, assert_pairwise_distinct, tiny_causal_lm, tiny_sensitive_llama

from polykv_agents import CompressionConfig, Engine, PooledAgent, SharedKVPool
from polykv_agents.runtime.backend import PrivateBackend
from polykv_agents.runtime.generate import generate_token_ids
from polykv_agents.runtime.prefix_tree import PrefixTrees
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler import BatchScheduler
from polykv_agents.sampling.settings import GenerationSettings

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 4
GREEDY = GenerationSettings(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_sensitive_llama()


@pytest.fixture(scope="module")
def pool(model, tiny_tok):
    return SharedKVPool.prefill(model, tiny_tok, DOC)


def _prompt(pool, model, tok, role: str, question: str = "What do values use?") -> torch.Tensor:
    return PooledAgent(pool, model, tok, system_prompt=f"You are the {role}.").prompt_ids(question)


def _full_prefill(model, tok, pool, prompt, settings=GREEDY) -> list[int]:
    """The reference: the whole prompt prefilled over a private copy of the decoded pool."""
    return list(generate_token_ids(DecodeRequest(model, tok, prompt, settings, pool=pool), PrivateBackend()))


def _submit(scheduler, prompt, settings=GREEDY):
    request = DecodeRequest(scheduler.model, scheduler._tokenizer, prompt, settings, pool=scheduler.prefix.pool)
    return scheduler.submit(request, settings.max_new_tokens), request.stats


def _scheduler(model, tok, pool, trees: PrefixTrees, **kwargs) -> BatchScheduler:
    return BatchScheduler(model, tok, pool, prefixes=trees, **kwargs)


def _recording_forwards(scheduler) -> list[tuple[int, int]]:
    """``(rows, query tokens)`` of every forward the scheduler runs, in order."""
    forwards: list[tuple[int, int]] = []
    forward = scheduler._forward
    scheduler._forward = lambda ids, cache: forwards.append(tuple(ids.shape)) or forward(ids, cache)
    return forwards


def test_a_prompt_that_extends_a_finished_call_prefills_only_its_new_tokens(model, tiny_tok, pool):
    """A follow-up turn: the first call's prompt, its answer, then a new question."""
    trees = PrefixTrees(max_bytes=10**9)
    scheduler = _scheduler(model, tiny_tok, pool, trees)
    forwards = _recording_forwards(scheduler)
    first_prompt = _prompt(pool, model, tiny_tok, "critic")
    stream, first = _submit(scheduler, first_prompt)
    answer = list(stream)
    assert first.reused_tokens == 0
    follow_up = torch.cat([first_prompt, torch.tensor(answer), _prompt(pool, model, tiny_tok, "critic", "Why?")[-9:]])
    stream, second = _submit(scheduler, follow_up)
    assert list(stream) == _full_prefill(model, tiny_tok, pool, follow_up)
    # Everything the first call ran through the model: its prompt and all but its last answer token.
    assert second.reused_tokens == first_prompt.numel() + len(answer) - 1
    assert second.prompt_tokens == follow_up.numel()  # still the call's own tokens, reused or not
    assert forwards[len(answer)] == (1, follow_up.numel() - second.reused_tokens)  # the follow-up's admission
    scheduler.close()


def test_rows_with_different_stored_starts_are_admitted_together_and_each_stays_exact(model, tiny_tok, pool):
    """One admission with a row that extends a stored call, one whose start is stored but shorter, and one with
    nothing stored: the columns are those of the longest part to prefill, and every row decodes exactly."""
    trees = PrefixTrees(max_bytes=10**9)
    scheduler = _scheduler(model, tiny_tok, pool, trees)
    base = _prompt(pool, model, tiny_tok, "planner")
    list(_submit(scheduler, base)[0])  # stores base and its answer
    forwards = _recording_forwards(scheduler)
    extended = torch.cat([base, torch.tensor([5, 6, 7, 8, 9])])  # diverges from the stored answer at once
    prompts = [extended, _prompt(pool, model, tiny_tok, "summarizer"), base[:-3]]
    expected = [_full_prefill(model, tiny_tok, pool, p) for p in prompts]
    assert_pairwise_distinct(expected)
    with scheduler._wake:  # held: the worker admits all three in one forward
        submitted = [_submit(scheduler, p) for p in prompts]
    assert [list(stream) for stream, _ in submitted] == expected
    widest = max(p.numel() - stats.reused_tokens for p, (_, stats) in zip(prompts, submitted, strict=True))
    assert forwards[0] == (3, widest)
    reused = [stats.reused_tokens for _, stats in submitted]
    assert reused[0] > reused[2] > 0 and reused[0] >= base.numel() - widest
    scheduler.close()


def test_a_call_that_reads_a_stored_prefix_while_others_decode_stays_exact(model, tiny_tok, pool):
    """A reused row joins running rows (chunked admission): the rows' different suffix lengths line up."""
    trees = PrefixTrees(max_bytes=10**9)
    scheduler = _scheduler(model, tiny_tok, pool, trees, admission_chunk_tokens=3)
    base = _prompt(pool, model, tiny_tok, "risk")
    list(_submit(scheduler, base)[0])
    long_running = GenerationSettings(max_new_tokens=30, ignore_eos=True)
    other = _prompt(pool, model, tiny_tok, "legal", "List every number in the document.")
    extended = torch.cat([base, torch.tensor([11, 12, 13, 14, 15, 16, 17])])
    expected = [
        _full_prefill(model, tiny_tok, pool, other, long_running),
        _full_prefill(model, tiny_tok, pool, extended),
    ]
    running, _ = _submit(scheduler, other, long_running)
    got_running = [next(running) for _ in range(3)]
    joining, stats = _submit(scheduler, extended)
    assert [got_running + list(running), list(joining)] == expected
    assert stats.reused_tokens == base.numel()
    scheduler.close()


def test_without_a_tree_nothing_is_reused(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    prompt = _prompt(pool, model, tiny_tok, "critic")
    list(_submit(scheduler, prompt)[0])
    stream, stats = _submit(scheduler, torch.cat([prompt, torch.tensor([3, 4])]))
    list(stream)
    assert stats.reused_tokens == 0
    scheduler.close()


def test_an_evicted_extension_is_prefilled_again_and_the_call_says_so(model, tiny_tok, pool):
    trees = PrefixTrees(max_bytes=10**9)
    scheduler = _scheduler(model, tiny_tok, pool, trees)
    prompt = _prompt(pool, model, tiny_tok, "critic")
    answer = list(_submit(scheduler, prompt)[0])
    trees.max_bytes = 0
    trees.evict_over_budget()
    follow_up = torch.cat([prompt, torch.tensor(answer)])
    stream, stats = _submit(scheduler, follow_up)
    assert list(stream) == _full_prefill(model, tiny_tok, pool, follow_up)
    assert (stats.reused_tokens, stats.evicted_tokens) == (0, prompt.numel() + len(answer) - 1)
    scheduler.close()


@functools.cache
def _family_model(family: str):
    return tiny_causal_lm(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_changes_no_greedy_token_on_any_family(family, tiny_tok):
    """A three-turn conversation through an engine: each turn extends the last one's prompt and answer, and
    decodes exactly the tokens of an engine that reuses nothing."""
    model = _family_model(family)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC[:75], config=CompressionConfig.full_precision())
    reusing, prefilling = Engine(), Engine(max_prefix_bytes=0)
    questions = ["What do values use?", "And keys?", "Why rotate?"]
    settings = GenerationSettings(max_new_tokens=8, ignore_eos=True)
    conversation = torch.empty(0, dtype=torch.long)
    reused, expected = [], []
    for question in questions:
        turn = PooledAgent(pool, model, tiny_tok, system_prompt="You are the critic.").prompt_ids(question)
        conversation = torch.cat([conversation, turn])
        calls = [DecodeRequest(model, tiny_tok, conversation, settings, pool=pool) for _ in range(2)]
        answers = [
            list(generate_token_ids(call, engine.backend("decompressed")))
            for call, engine in zip(calls, (reusing, prefilling), strict=True)
        ]
        assert answers[0] == answers[1], question
        expected.append(answers[1])
        reused.append(calls[0].stats.reused_tokens)
        assert calls[1].stats.reused_tokens == 0
        conversation = torch.cat([conversation, torch.tensor(answers[0])])
    assert_pairwise_distinct(expected)
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])
    assert pool.num_tokens + conversation.numel() > SLIDING_WINDOW  # reused keys also leave the window
    reusing.close()
    prefilling.close()
