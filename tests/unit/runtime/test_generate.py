"""The decode path's entry points: a request's token budget, the backends by name, stop sequences on text."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tiny_models import tiny_sensitive_llama

from polykv_agents import SharedKVPool
from polykv_agents.runtime import request as request_module
from polykv_agents.runtime.backend import RUNTIMES, BatchedBackend, PrivateBackend, check_runtime
from polykv_agents.runtime.generate import generate_text, generate_token_ids
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler_table import SchedulerTable
from polykv_agents.sampling.settings import GenerationSettings

POSITIONS = 40
"""The tiny model's positions: a short document and prompt reach its end."""


@pytest.fixture(scope="module")
def model():
    return tiny_sensitive_llama()


class _Scripted:
    """A backend that yields fixed token ids and records whether its iterator was closed."""

    name = "scripted"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.calls, self.closed = tokens, 0, False

    def decode(self, request: DecodeRequest, budget: int) -> Iterator[int]:
        self.calls += 1
        try:
            yield from self.tokens[:budget]
            request.stats.finish_reason = "length"
        finally:
            self.closed = True


def test_the_token_budget_is_capped_by_the_positions_the_model_has_left(model, tiny_tok, monkeypatch):
    monkeypatch.setattr(request_module, "max_positions", lambda _: POSITIONS)
    pool = SharedKVPool.prefill(model, tiny_tok, "A short document.")
    used = POSITIONS - pool.num_tokens - 1  # a prompt that leaves exactly one position
    request = DecodeRequest(model, tiny_tok, torch.arange(3, 3 + used), GenerationSettings(max_new_tokens=5), pool)
    assert (request.start_position, request.token_budget()) == (pool.num_tokens, 1)
    assert (request.stats.prompt_tokens, request.stats.cached_tokens) == (used, pool.num_tokens)
    short = DecodeRequest(model, tiny_tok, torch.arange(3, 8), GenerationSettings(max_new_tokens=5))
    assert (short.start_position, short.token_budget()) == (0, 5)  # no pool: positions from 0
    full = DecodeRequest(model, tiny_tok, torch.arange(3, 4 + used), GenerationSettings(), pool)
    message = rf"\({pool.num_tokens} tokens\).*\({used + 1} tokens\).*{POSITIONS} positions"
    with pytest.raises(ValueError, match=message):
        full.token_budget()
    monkeypatch.setattr(request_module, "max_positions", lambda _: None)  # a model that does not say
    assert DecodeRequest(model, tiny_tok, torch.arange(3, 4 + used), GenerationSettings(), pool).token_budget() == 256


def test_a_zero_budget_never_reaches_the_backend(model, tiny_tok):
    backend = _Scripted([5, 6])
    request = DecodeRequest(model, tiny_tok, torch.arange(3, 8), GenerationSettings(max_new_tokens=0))
    assert list(generate_token_ids(request, backend)) == []
    assert (backend.calls, request.stats.finish_reason) == (0, "length")


def test_text_ends_before_the_first_stop_sequence_and_frees_the_backend(model, tiny_tok):
    tokens = tiny_tok.encode("keys and values STOP codebook", add_special_tokens=False)
    backend = _Scripted(tokens)
    settings = GenerationSettings(max_new_tokens=len(tokens), stop=["STOP"])
    request = DecodeRequest(model, tiny_tok, torch.arange(3, 8), settings)
    assert "".join(generate_text(request, backend)).rstrip() == "keys and values"
    assert request.stats.finish_reason == "stop"
    assert backend.closed  # the token loop was closed at the stop, not left suspended
    assert 0 < request.stats.output_tokens < len(tokens)


def test_text_held_back_as_a_possible_stop_is_released_at_the_end(model, tiny_tok):
    tokens = tiny_tok.encode("keys and values ST", add_special_tokens=False)  # "ST" may still become "STOP"
    backend = _Scripted(tokens)
    settings = GenerationSettings(max_new_tokens=50, stop=["STOP"])
    request = DecodeRequest(model, tiny_tok, torch.arange(3, 8), settings)
    assert "".join(generate_text(request, backend)) == "keys and values ST"
    assert (request.stats.output_tokens, request.stats.finish_reason) == (len(tokens), "length")


def test_a_structured_answer_is_never_cut_by_a_stop_sequence(model, tiny_tok):
    text = '<tool_call>{"a": "STOP"}'
    settings = GenerationSettings(
        max_new_tokens=50, stop=["STOP"], grammar='{"type": "object"}', structured_opening="<tool_call>"
    )
    request = DecodeRequest(model, tiny_tok, torch.arange(3, 8), settings)
    assert "".join(generate_text(request, _Scripted(tiny_tok.encode(text, add_special_tokens=False)))) == text


def test_runtimes_are_checked_by_name():
    assert RUNTIMES == ("auto", "decompressed", "compressed", "private")
    for runtime in RUNTIMES:
        assert check_runtime(runtime) == runtime
    with pytest.raises(
        ValueError, match="runtime must be one of 'auto', 'decompressed', 'compressed', 'private', got 'gpu'"
    ):
        check_runtime("gpu")


def test_a_batched_backend_decodes_a_call_without_a_pool_alone(model, tiny_tok):
    table = SchedulerTable()
    backend = BatchedBackend(table, "compressed")
    assert (backend.name, backend.residency) == ("compressed", "compressed")
    settings = GenerationSettings(max_new_tokens=6)
    prompt = torch.arange(3, 9)
    got = list(generate_token_ids(DecodeRequest(model, tiny_tok, prompt, settings), backend))
    assert got == list(generate_token_ids(DecodeRequest(model, tiny_tok, prompt, settings), PrivateBackend()))
    assert len(got) == 6 and len(table) == 0  # no scheduler was started for it
