"""Reuse of text at other positions (``reuse="blocks"``): a call whose prompt quotes what an earlier call ran through
the model moves those keys and values instead of prefilling them, recomputes the configured fraction, and never
lets the approximation into the exact prefix tree."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from tiny_models import FAMILIES, SLIDING_WINDOW, tiny_causal_lm, tiny_sensitive_llama

from polykv_agents import CompressionConfig, Engine, SharedKVPool
from polykv_agents.runtime import reuse as reuse_module
from polykv_agents.runtime.backend import PrivateBackend
from polykv_agents.runtime.block_reuse import compose_start
from polykv_agents.runtime.block_store import BlockStore
from polykv_agents.runtime.generate import generate_token_ids
from polykv_agents.runtime.prefix_tree import PrefixMatch, PrefixTrees, common_length
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler import BatchScheduler
from polykv_agents.sampling.settings import GenerationSettings

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 2
FINDING = "The critic reads every finding; the planner splits the review into parts. " * 2
GREEDY = GenerationSettings(max_new_tokens=10, ignore_eos=True)
BLOCKS = GREEDY.model_copy(update={"reuse": "blocks"})


@pytest.fixture(scope="module")
def model():
    return tiny_sensitive_llama()


@pytest.fixture(scope="module")
def pool(model, tiny_tok):
    return SharedKVPool.prefill(model, tiny_tok, DOC)


def _ids(tok, text: str) -> torch.Tensor:
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def _prompts(tok) -> tuple[torch.Tensor, torch.Tensor]:
    """A specialist's prompt holding the finding, and a critic's prompt quoting it later, at another position."""
    specialist = _ids(tok, "<|im_start|>user\nYour finding: " + FINDING + "<|im_end|>\n<|im_start|>assistant\n")
    critic = _ids(tok, "<|im_start|>user\nThe specialists wrote, first of all:\n" + FINDING + "Which is weakest?")
    return specialist, critic


def _full_prefill(model, tok, pool, prompt, settings=GREEDY) -> list[int]:
    return list(generate_token_ids(DecodeRequest(model, tok, prompt, settings, pool=pool), PrivateBackend()))


def _run(scheduler, prompt, settings):
    request = DecodeRequest(scheduler.model, scheduler._tokenizer, prompt, settings, pool=scheduler.prefix.pool)
    return list(scheduler.submit(request, settings.max_new_tokens)), request.stats


def _scheduler(model, tok, pool, **kwargs) -> BatchScheduler:
    return BatchScheduler(model, tok, pool, prefixes=PrefixTrees(10**9), blocks=BlockStore(10**9), **kwargs)


def test_a_quoted_block_is_moved_not_prefilled_and_counted_as_read(model, tiny_tok, pool):
    scheduler = _scheduler(model, tiny_tok, pool)
    specialist, critic = _prompts(tiny_tok)
    _run(scheduler, specialist, GREEDY)
    settings = BLOCKS.model_copy(update={"block_recompute": 0.0})
    answer, stats = _run(scheduler, critic, settings)
    quoted = _ids(tiny_tok, FINDING).numel()
    assert quoted - 4 <= stats.block_tokens <= quoted  # its boundary tokens may merge with the text around it
    # Read, not computed: the moved block and the start both prompts share ("<|im_start|>user\n..."), exact.
    assert stats.reused_tokens == stats.block_tokens + common_length(specialist.tolist(), critic.tolist())
    # Moved keys attended to the specialist's prompt, not the critic's: not what a full prefill decodes.
    assert answer != _full_prefill(model, tiny_tok, pool, critic)
    scheduler.close()


def test_recomputing_the_whole_block_decodes_exactly_what_a_full_prefill_does(model, tiny_tok, pool):
    scheduler = _scheduler(model, tiny_tok, pool)
    specialist, critic = _prompts(tiny_tok)
    _run(scheduler, specialist, GREEDY)
    answer, stats = _run(scheduler, critic, BLOCKS.model_copy(update={"block_recompute": 1.0}))
    assert stats.block_tokens == 0  # all recomputed
    assert answer == _full_prefill(model, tiny_tok, pool, critic)
    scheduler.close()


@pytest.mark.parametrize("recompute", [0.0, 1.0])
def test_an_exact_call_never_reads_what_a_blocks_call_composed(model, tiny_tok, pool, recompute):
    """The critic's row holds moved keys past the quote's start (recomputed or not: the tree holds prefills only);
    a follow-up that extends the critic's tokens with reuse='exact' must read only the exact part from the tree,
    and decode what a full prefill does."""
    scheduler = _scheduler(model, tiny_tok, pool)
    specialist, critic = _prompts(tiny_tok)
    _run(scheduler, specialist, GREEDY)
    answer, composed = _run(scheduler, critic, BLOCKS.model_copy(update={"block_recompute": recompute}))
    follow_up = torch.cat([critic, torch.tensor(answer), _ids(tiny_tok, " Why?")])
    exact_answer, exact = _run(scheduler, follow_up, GREEDY)
    first_moved = critic.numel() - _ids(tiny_tok, FINDING + "Which is weakest?").numel()
    assert 0 < exact.reused_tokens <= first_moved + 2 and exact.block_tokens == 0
    assert exact_answer == _full_prefill(model, tiny_tok, pool, follow_up)
    assert (composed.block_tokens > 0) == (recompute == 0.0)  # all recomputed: read nothing moved
    scheduler.close()


def test_without_a_quote_a_blocks_call_is_an_exact_call(model, tiny_tok, pool):
    scheduler = _scheduler(model, tiny_tok, pool)
    prompt = _ids(tiny_tok, "<|im_start|>user\nNothing quoted here at all.<|im_end|>\n<|im_start|>assistant\n")
    answer, stats = _run(scheduler, prompt, BLOCKS)
    assert stats.block_tokens == 0 and answer == _full_prefill(model, tiny_tok, pool, prompt)
    scheduler.close()


@functools.cache
def _family(family: str):
    return tiny_causal_lm(family)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])
def test_full_recompute_is_exact_on_every_movable_family_through_an_engine(family, tiny_tok, monkeypatch):
    """Short texts, so that pool and prompt fit the sliding window of Mistral's and Gemma 2's tiny models."""
    composed = []
    monkeypatch.setattr(reuse_module, "compose_start", lambda *a: composed.append(a) or compose_start(*a))
    model = _family(family)
    engine = Engine(max_block_bytes=10**9)
    pool = SharedKVPool.prefill(model, tiny_tok, "Values.", config=CompressionConfig.full_precision())
    quote = "The critic reads every finding."
    first = DecodeRequest(model, tiny_tok, _ids(tiny_tok, quote + " Go"), GREEDY, pool=pool)
    list(generate_token_ids(first, engine.backend("decompressed")))
    critic = _ids(tiny_tok, "Quote: " + quote + " Which?")
    assert pool.num_tokens + critic.numel() + GREEDY.max_new_tokens < SLIDING_WINDOW
    request = DecodeRequest(model, tiny_tok, critic, BLOCKS.model_copy(update={"block_recompute": 1.0}), pool=pool)
    answer = list(generate_token_ids(request, engine.backend("decompressed")))
    assert len(composed) == 1  # the quote was found and composed, all of it recomputed
    assert answer == _full_prefill(model, tiny_tok, pool, critic)
    engine.close()


def test_blocks_on_an_engine_without_a_block_budget_are_refused_with_what_to_do(model, tiny_tok, pool):
    scheduler = BatchScheduler(model, tiny_tok, pool)
    with pytest.raises(ValueError, match=r"Engine\(max_block_bytes="):
        _run(scheduler, _prompts(tiny_tok)[1], BLOCKS)
    scheduler.close()


def test_blocks_on_a_model_with_absolute_positions_are_refused_before_any_work(tiny_tok):
    model = _family("gpt2")
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    scheduler = _scheduler(model, tiny_tok, pool)
    with pytest.raises(ValueError, match="no rotary position embedding"):
        _run(scheduler, _prompts(tiny_tok)[1], BLOCKS)
    scheduler.close()


def test_two_quotes_apart_with_full_recompute_decode_what_a_full_prefill_does(model, tiny_tok, pool, monkeypatch):
    """The text between two moved blocks is computed in the composition too (never left as empty slots)."""
    composed = []
    monkeypatch.setattr(reuse_module, "compose_start", lambda *a: composed.append(a[4]) or compose_start(*a))
    scheduler = _scheduler(model, tiny_tok, pool)
    second = "Values are rotated before they are quantised to three bits each. " * 2
    for text in (FINDING, second):
        _run(scheduler, _ids(tiny_tok, "<|im_start|>user\nYour finding: " + text), GREEDY)
    critic = _ids(tiny_tok, "Findings:\n1. " + FINDING + "\nand then, second:\n2. " + second + "Which is weakest?")
    answer, _ = _run(scheduler, critic, BLOCKS.model_copy(update={"block_recompute": 1.0}))
    assert len(composed) == 1 and len(composed[0]) >= 2  # one composition, a gap between its quotes
    assert answer == _full_prefill(model, tiny_tok, pool, critic)
    scheduler.close()


def test_moved_first_layer_keys_and_values_are_a_full_prefills(model, tiny_tok, pool):
    """A first layer's keys and values depend on the token and its position only: moved ones must be exact there
    (deeper layers keep what the tokens attended to where they were computed)."""
    scheduler = _scheduler(model, tiny_tok, pool)
    specialist, critic = _prompts(tiny_tok)
    _run(scheduler, specialist, GREEDY)
    deadline = time.monotonic() + 10
    while not (occurrences := scheduler.blocks.find(model, pool.digest, critic.tolist(), 0, critic.numel() - 1)):
        assert time.monotonic() < deadline, "the specialist's tokens were never stored"
        time.sleep(0.01)  # the worker stores a finished row just after its consumer's last token
    assert len(occurrences) == 1 and occurrences[0].shift != 0
    start = compose_start(model, scheduler.prefix, PrefixMatch(), critic.tolist(), occurrences, 0.0)
    reference = SharedKVPool.prefill_tokens(
        model, tiny_tok, torch.cat([pool.token_ids, critic]), config=CompressionConfig.full_precision()
    )
    moved = slice(occurrences[0].start, occurrences[0].start + occurrences[0].length)
    at = slice(pool.num_tokens + moved.start, pool.num_tokens + moved.stop)
    keys, values = start.layer(0)
    ref_keys, ref_values = reference.decompress_layer(0)
    torch.testing.assert_close(keys[:, moved], ref_keys[0, :, at], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(values[:, moved], ref_values[0, :, at], atol=1e-5, rtol=1e-4)
    last_keys, _ = start.layer(model.config.num_hidden_layers - 1)
    ref_last, _ = reference.decompress_layer(model.config.num_hidden_layers - 1)
    assert not torch.allclose(last_keys[:, moved], ref_last[0, :, at], atol=1e-3)
    scheduler.close()


def test_a_composition_that_fails_falls_back_to_prefilling_and_the_call_is_right(model, tiny_tok, pool, monkeypatch):
    def broken(*args):
        raise RuntimeError("out of memory while composing")

    monkeypatch.setattr(reuse_module, "compose_start", broken)
    scheduler = _scheduler(model, tiny_tok, pool)
    specialist, critic = _prompts(tiny_tok)
    _run(scheduler, specialist, GREEDY)
    answer, stats = _run(scheduler, critic, BLOCKS.model_copy(update={"block_recompute": 0.0}))
    assert stats.block_tokens == 0 and answer == _full_prefill(model, tiny_tok, pool, critic)
    scheduler.close()


def _layers(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, n, 4), torch.zeros(1, n, 4))]  # one layer, [KVH, n, D]: 32 bytes a token


def test_the_block_store_keeps_the_recently_read_blocks_under_its_budget(model):
    one = 20 * 32  # bytes of a 20-token block
    store = BlockStore(max_bytes=2 * one)
    a, b, c = (list(range(base, base + 20)) for base in (100, 200, 300))
    store.add(model, "pool", a, _layers(20))
    store.add(model, "pool", b, _layers(20))
    assert [o.offset for o in store.find(model, "pool", [7, *a, 9], 0, 22)] == [0]  # reading a makes b the oldest
    store.add(model, "pool", c, _layers(20))
    assert store.nbytes == 2 * one and store.evictions == 1
    assert store.find(model, "pool", b, 0, 20) == []
    assert len(store.find(model, "pool", [*a, *c], 0, 40)) == 2
    assert store.find(model, "other pool", a, 0, 20) == []  # blocks are per pool


def test_short_and_repeated_blocks_are_not_stored_twice(model):
    store = BlockStore(max_bytes=10**6)
    store.add(model, "pool", list(range(15)), _layers(15))  # under MIN_BLOCK_TOKENS
    store.add(model, "pool", list(range(20)), _layers(20))
    store.add(model, "pool", list(range(20)), _layers(20))
    assert store.nbytes == 20 * 32
    (occurrence,) = store.find(model, "pool", [50, 51, *range(3, 20), 52], 0, 20)
    assert (occurrence.start, occurrence.offset, occurrence.length, occurrence.shift) == (2, 3, 17, -1)
    with pytest.raises(ValueError, match="non-negative"):
        BlockStore(max_bytes=-1)
