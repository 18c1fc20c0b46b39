"""The private runtime: a call decodes alone, follows its own grammar and runs no forward it does not need."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_sensitive_llama

from polykv_agents.runtime import private
from polykv_agents.runtime.private import private_tokens
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.sampling.settings import GenerationSettings

PROMPT = torch.arange(3, 9)


@pytest.fixture(scope="module")
def model():
    return tiny_sensitive_llama()


class _Forced:
    """A grammar state that allows exactly ``tokens``, one after the other, and is finished after the last."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.done = tokens, 0

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():  # the logits are an inference tensor
            allowed = logits.new_full(logits.shape, float("-inf"))
            allowed[self.tokens[self.done]] = 0.0
            return logits.add_(allowed)

    def advance(self, token: int) -> None:
        assert token == self.tokens[self.done]
        self.done += 1

    @property
    def finished(self) -> bool:
        return self.done == len(self.tokens)

    closing = False  # a grammar this short never needs closing to fit the budget

    def closing_token(self, remaining: int) -> int | None:
        return None


def test_a_private_call_follows_its_own_grammar_and_stops_where_it_ends(model, tiny_tok, monkeypatch):
    settings = GenerationSettings(max_new_tokens=6)
    free = list(private_tokens(DecodeRequest(model, tiny_tok, PROMPT, settings), 6))
    forced = [t for t in (7, 9, 11) if t not in free[:2]][:2]  # a grammar the free answer does not follow
    built = []

    def token_constraint(*args):
        built.append(args)
        return _Forced(forced)

    monkeypatch.setattr(private, "token_constraint", token_constraint)
    request = DecodeRequest(model, tiny_tok, PROMPT, settings)
    assert list(private_tokens(request, 6)) == forced
    assert built == [(model, tiny_tok, settings)]
    assert request.stats.finish_reason == "stop"


def test_the_last_token_is_never_forwarded(model, tiny_tok, monkeypatch):
    calls = []
    forward = private.forward_with_cache

    def counting_forward(*args, **kwargs):
        calls.append(args[1].shape[-1])
        return forward(*args, **kwargs)

    monkeypatch.setattr(private, "forward_with_cache", counting_forward)
    request = DecodeRequest(model, tiny_tok, PROMPT, GenerationSettings(max_new_tokens=4, ignore_eos=True))
    assert len(list(private_tokens(request, 4))) == 4
    assert calls == [PROMPT.numel(), 1, 1, 1]  # the prompt, then one forward per token but the last
    assert request.stats.finish_reason == "length"
