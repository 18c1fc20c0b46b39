"""bf16, the default dtype: the batched, packed, compiled and prefix-tree paths decode what the private runtime
(each call alone over its own copy of the pool) decodes, within bf16's rounding.

The rest of the suite pins fp32 (``tests/conftest.py``), where those paths are exact token for token. In bf16 they
are not: batching changes the shapes of the matrix products and so their order of summation, cascade attention
reads the prefix and the suffix apart and merges them in fp32, and Inductor fuses operations, so each path rounds
differently. What the tests hold each path to, against the private runtime on the same prompts (greedy, 16 tokens,
top-5 logprobs):

- At every step up to and including the first token where the two differ (their contexts are still the same
  there), the log-probabilities of the top-5 tokens both report differ by at most :data:`FIRST_STEP_ATOL` at the
  first step and :data:`ATOL` after it, and each side's token is in the other's top 5.
- Over all those steps and rows, the differences average at most :data:`MEAN_ATOL`: rounding errors scatter
  around zero, an error in a path (a softmax merge weighted wrong, a key at the wrong position) shifts them all.
- Where the tokens differ, the private runtime's two candidates are a near-tie: at most twice that step's
  tolerance apart, so that errors within it on each can swap them. Later steps are not compared (the contexts
  differ from there on).

A path that reads another row's cache, a wrong position or a skipped mask moves log-probabilities by far more, at
the first step already. The model is :func:`tiny_sensitive_llama` in bf16 (large weights: answers
that depend on the prompt; logits up to about 7, where bf16's spacing is 1/32), over the default compressed pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from tiny_models import assert_pairwise_distinct, tiny_sensitive_llama

from polykv_agents import GenerationSettings, PooledAgent, SharedKVPool
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.runtime import compiled_decode
from polykv_agents.runtime.backend import PrivateBackend
from polykv_agents.runtime.generate import generate_token_ids
from polykv_agents.runtime.packed_step import PackedCascade
from polykv_agents.runtime.prefix_tree import PrefixTrees
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler import BatchScheduler
from polykv_agents.sampling.logprobs import TokenLogprob

FIRST_STEP_ATOL = 0.15
"""The first token's log-probabilities come from the prompt's prefill over the same pool: every path computes the
same thing, grouped differently. Measured (this model with seeds 1 to 6, three prompts each, every path): at most
0.092, about three of bf16's spacings at these logits."""

ATOL = 0.5
"""Each later step also reads the keys and values the path wrote for the answer so far, rounded its own way, so
differences grow along the answer. Measured as above over 16 steps: at most 0.21 on the eager paths and 0.31
through Inductor's kernels. bf16 itself drifts from fp32 by up to 0.6 within eight steps (the private runtime in
both dtypes): within 0.5, a path is as close to the private runtime as bf16's own rounding allows."""

MEAN_ATOL = 0.05
"""The mean of those differences over all compared steps (about 240 log-probabilities). Measured as above: 0.021
to 0.031 on the eager paths, 0.028 to 0.038 through Inductor's kernels. Cascade attention's merge with the
suffix's weight 10% too large averages 0.062 to 0.076, though no single difference exceeds the tolerances above."""

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 3
QUESTIONS = ("What do values use?", "Summarise it.", "Which part is rotated, and why would that matter?")
NEW_TOKENS = 16
SETTINGS = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)

Answer = tuple[list[int], list[TokenLogprob]]
"""A call's greedy tokens and, per token, its logprob and the top 5."""


@pytest.fixture(scope="module")
def model():
    return tiny_sensitive_llama().to(torch.bfloat16)


@pytest.fixture(scope="module")
def pool(model, tiny_tok):
    return SharedKVPool.prefill(model, tiny_tok, DOC)


@pytest.fixture(scope="module")
def prompts(model, tiny_tok, pool) -> list[torch.Tensor]:
    agent = PooledAgent(pool, model, tiny_tok)
    return [agent.prompt_ids(question) for question in QUESTIONS]


def _request(model, tok, pool, prompt: torch.Tensor) -> DecodeRequest:
    return DecodeRequest(model, tok, prompt, SETTINGS, pool=pool)


def _private(model, tok, pool, prompts: Sequence[torch.Tensor]) -> list[Answer]:
    """The reference: each prompt alone, over a private copy of the decoded pool."""
    answers = []
    for prompt in prompts:
        request = _request(model, tok, pool, prompt)
        answers.append((list(generate_token_ids(request, PrivateBackend())), request.stats.logprobs))
    return answers


@pytest.fixture(scope="module")
def reference(model, tiny_tok, pool, prompts) -> list[Answer]:
    answers = _private(model, tiny_tok, pool, prompts)
    assert_pairwise_distinct([tokens for tokens, _ in answers])  # rows mixed up would show
    return answers


def _admitted_together(scheduler: BatchScheduler, requests: Sequence[DecodeRequest]) -> list[Answer]:
    """``requests`` queued while this thread holds the compute thread, so that one admission takes them all."""
    streams = run_on_compute_thread(lambda: [scheduler.submit(r, NEW_TOKENS) for r in requests])
    return [(list(stream), r.stats.logprobs) for stream, r in zip(streams, requests, strict=True)]


def assert_close_to_private(got: Sequence[Answer], reference: Sequence[Answer]) -> None:
    """Each row of ``got`` against the same row of ``reference`` as the module docstring says."""
    assert len(got) == len(reference)
    differences = []
    for row, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(got, reference, strict=True)):
        assert len(tokens) == len(want_tokens) == NEW_TOKENS, row
        for step, (token, want) in enumerate(zip(tokens, want_tokens, strict=True)):
            top, want_top = dict(logprobs[step].top), dict(want_logprobs[step].top)
            tolerance = FIRST_STEP_ATOL if step == 0 else ATOL
            where = f"row {row}, step {step}"
            assert token in want_top and want in top, f"{where}: {token} and {want} are not in each other's top 5"
            for candidate in top.keys() & want_top.keys():
                difference = abs(top[candidate] - want_top[candidate])
                assert difference <= tolerance, f"{where}: token {candidate}'s logprob differs by {difference:.3f}"
                differences.append(difference)
            if token != want:
                gap = want_top[want] - want_top[token]
                assert gap <= 2 * tolerance, f"{where}: {token} instead of {want}, {gap:.3f} less likely: no near-tie"
                break
    mean = sum(differences) / len(differences)
    assert mean <= MEAN_ATOL, f"logprobs differ by {mean:.3f} on average over {len(differences)}: more than rounding"


def test_rows_batched_in_one_admission_decode_what_the_private_runtime_does(model, tiny_tok, pool, prompts, reference):
    """Three prompts of different lengths admitted together (left padding), then decoded in one batch."""
    scheduler = BatchScheduler(model, tiny_tok, pool, admission_chunk_tokens=None)
    try:
        got = _admitted_together(scheduler, [_request(model, tiny_tok, pool, p) for p in prompts])
    finally:
        scheduler.close()
    assert_close_to_private(got, reference)


def _counting(monkeypatch, cls: type, method: str) -> list[int]:
    """Counts calls of ``cls.method`` (one per forward of that kind) for the test's duration."""
    calls: list[int] = []
    original: Callable = getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, *args: calls.append(1) or original(self, *args))
    return calls


def test_prompts_admitted_in_packed_chunks_decode_what_the_private_runtime_does(
    model, tiny_tok, pool, prompts, reference, monkeypatch
):
    """Two prompts join a decoding row six tokens a step, each step one forward with that row's token."""
    packed_steps = _counting(monkeypatch, PackedCascade, "kept_positions")
    scheduler = BatchScheduler(model, tiny_tok, pool, admission_chunk_tokens=6)
    requests = [_request(model, tiny_tok, pool, p) for p in prompts]
    try:
        first = scheduler.submit(requests[0], NEW_TOKENS)
        tokens = [next(first)]  # the first row decodes before the others are queued
        joining = _admitted_together(scheduler, requests[1:])
        tokens += list(first)
    finally:
        scheduler.close()
    assert packed_steps
    assert_close_to_private([(tokens, requests[0].stats.logprobs), *joining], reference)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_steps_decode_what_the_private_runtime_does(backend, model, tiny_tok, pool, prompts, reference):
    """The decode step through ``torch.compile``: dynamo's graph run by AOT autograd (``aot_eager``), and real
    Inductor kernels, which need a C++ compiler. Three rows admitted together: one bucket (four) compiles."""
    if backend == "inductor" and not compiled_decode.cpp_toolchain_available():
        pytest.skip("Inductor finds no working C++ compiler here")
    scheduler = BatchScheduler(
        model, tiny_tok, pool, admission_chunk_tokens=None, compile_decode=True if backend == "inductor" else backend
    )
    try:
        got = _admitted_together(scheduler, [_request(model, tiny_tok, pool, p) for p in prompts])
    finally:
        scheduler.close()
    assert scheduler.compiled is not None and scheduler.compiled.failed is None
    assert set(scheduler.compiled.compile_seconds) == {4}  # compiled, not run eager
    assert_close_to_private(got, reference)


def test_follow_ups_that_reuse_stored_prefixes_decode_what_the_private_runtime_does(
    model, tiny_tok, pool, prompts, reference
):
    """Each first call leaves its tokens' keys and values in the pool's prefix tree; the follow-ups (prompt, answer,
    a new question) prefill only their new tokens over them, admitted together."""
    agent = PooledAgent(pool, model, tiny_tok)
    follow_ups = [
        torch.cat([prompt, torch.tensor(tokens), agent.prompt_ids("And why?")])
        for prompt, (tokens, _) in zip(prompts, reference, strict=True)
    ]
    trees = PrefixTrees(max_bytes=10**9)
    scheduler = BatchScheduler(model, tiny_tok, pool, admission_chunk_tokens=None, prefixes=trees)
    try:
        for prompt in prompts:
            list(scheduler.submit(_request(model, tiny_tok, pool, prompt), NEW_TOKENS))
        requests = [_request(model, tiny_tok, pool, p) for p in follow_ups]
        got = _admitted_together(scheduler, requests)
    finally:
        scheduler.close()
    assert all(r.stats.reused_tokens >= p.numel() for r, p in zip(requests, prompts, strict=True))  # prompt and more
    assert_close_to_private(got, _private(model, tiny_tok, pool, follow_ups))
