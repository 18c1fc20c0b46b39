"""GenerationSettings validation and next_token: greedy, seeded sampling, nucleus, temperature."""

from __future__ import annotations

import math
from collections import Counter

import pydantic
import pytest
import torch

from polykv_agents.sampling.settings import GenerationSettings, next_token

# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"stop": [1]}, "stop"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict, field: str) -> None:
    """Out-of-range values and misspelt options fail at construction, naming the field."""
    with pytest.raises(pydantic.ValidationError, match=field):
        GenerationSettings(**kwargs)


def test_boundary_values_are_accepted() -> None:
    """0 tokens (empty answer), temperature 0 (greedy) and top_p 1 (no nucleus cut) are legal."""
    settings = GenerationSettings(max_new_tokens=0, temperature=0.0, top_p=1.0)
    assert settings.max_new_tokens == 0
    assert GenerationSettings(top_p=1e-9).top_p == 1e-9


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, ()),
        ("###", ("###",)),
        (["a", "bc"], ("a", "bc")),
        (("x",), ("x",)),
        ([], ()),
    ],
)
def test_stop_is_normalised_to_a_tuple(stop: object, expected: tuple[str, ...]) -> None:
    """A single string is one stop sequence (not one per character); None means none."""
    assert GenerationSettings(stop=stop).stop == expected


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_empty_stop_is_rejected_with_a_clear_message(stop: object) -> None:
    """An empty stop string would end every answer before it starts; it is refused, and the
    message says what to remove."""
    with pytest.raises(pydantic.ValidationError, match="non-empty") as info:
        GenerationSettings(stop=stop)
    assert "empty string" in str(info.value)


def test_settings_are_frozen() -> None:
    settings = GenerationSettings()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        settings.temperature = 1.0


def test_make_generator() -> None:
    """Greedy needs no generator; a seeded one reproduces its stream; unseeded ones differ."""
    assert GenerationSettings(temperature=0.0, seed=1).make_generator() is None
    a = GenerationSettings(temperature=1.0, seed=5).make_generator()
    b = GenerationSettings(temperature=1.0, seed=5).make_generator()
    assert a is not None and b is not None
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    c = GenerationSettings(temperature=1.0).make_generator()
    d = GenerationSettings(temperature=1.0).make_generator()
    assert not torch.equal(torch.rand(8, generator=c), torch.rand(8, generator=d))


# --------------------------------------------------------------------------- next_token


def _draws(logits: torch.Tensor, settings: GenerationSettings, n: int) -> list[int]:
    generator = settings.make_generator()
    return [next_token(logits, settings, generator) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)).to(dtype)
    token = next_token(logits, GenerationSettings(), None)
    assert isinstance(token, int)
    assert token == int(logits.float().argmax())


def test_sampling_settings_without_a_generator_fall_back_to_greedy() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert next_token(logits, GenerationSettings(temperature=1.5), None) == 1


def test_seeded_sampling_is_reproducible() -> None:
    """The same seed gives the same sample sequence; another seed gives another one."""
    logits = torch.zeros(10)  # uniform: the sequence is entirely the generator's
    settings = GenerationSettings(temperature=1.0, seed=42)
    first = _draws(logits, settings, 40)
    assert first == _draws(logits, settings, 40)
    assert first != _draws(logits, GenerationSettings(temperature=1.0, seed=43), 40)
    assert len(set(first)) > 3  # it really samples


def test_tiny_top_p_keeps_only_the_argmax() -> None:
    """The top token is always kept, so a nucleus smaller than its probability is just greedy."""
    logits = torch.randn(30, generator=torch.Generator().manual_seed(1))
    settings = GenerationSettings(temperature=5.0, top_p=1e-6, seed=0)
    assert set(_draws(logits, settings, 200)) == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    """probs [0.6, 0.3, 0.1]: top_p 0.7 keeps {0, 1} (0.6 < 0.7, then 0.9 >= 0.7), top_p 0.6 keeps
    only {0}, top_p 0.95 keeps all three."""
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    assert set(_draws(logits, GenerationSettings(temperature=1.0, top_p=0.7, seed=0), 400)) == {0, 1}
    assert set(_draws(logits, GenerationSettings(temperature=1.0, top_p=0.6, seed=0), 200)) == {0}
    assert set(_draws(logits, GenerationSettings(temperature=1.0, top_p=0.95, seed=0), 600)) == {0, 1, 2}


def test_masked_tokens_are_never_sampled() -> None:
    logits = torch.tensor([0.0, -math.inf, 0.0, -math.inf])
    assert set(_draws(logits, GenerationSettings(temperature=1.0, seed=3), 200)) == {0, 2}


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_sampling_follows_the_tempered_softmax(temperature: float) -> None:
    """Empirical frequencies over 6000 draws match softmax(logits / T) within 0.03.

    (The standard deviation of each frequency is at most 0.0065, so 0.03 is over 4.5 sigma.) This
    catches a temperature applied the wrong way round (T instead of 1/T) or not at all: at T = 2
    and T = 0.5 the expected frequencies differ from the T = 1 ones by at least 0.08.
    """
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    expected = torch.softmax(logits / temperature, dim=-1)
    n = 6000
    counts = Counter(_draws(logits, GenerationSettings(temperature=temperature, seed=7), n))
    observed = torch.tensor([counts[i] / n for i in range(3)])
    assert torch.allclose(observed, expected, atol=0.03), (observed, expected)


def test_tiny_temperature_acts_like_greedy() -> None:
    logits = torch.tensor([0.0, 10.0, 20.0])
    settings = GenerationSettings(temperature=1e-38, seed=0)
    assert next_token(logits, settings, settings.make_generator()) == 2


def test_the_repetition_penalty_is_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from polykv_agents.sampling.settings import penalize_repetitions

    torch.manual_seed(0)
    logits, seen = torch.randn(50), {3, 7, 11, 42}
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([sorted(seen)]), logits.clone()[None])[0]
    with torch.inference_mode():  # as the runtime's logits are
        inference_logits = logits.clone()
    ours = penalize_repetitions(inference_logits, seen, 1.3)
    assert torch.equal(ours, expected) and not torch.equal(ours, logits)


@pytest.mark.parametrize(("setting", "allowed"), [({"top_k": 3}, {0, 1, 2}), ({"min_p": 0.75}, {0, 1})])
def test_top_k_and_min_p_draw_only_what_they_keep(setting, allowed):
    """Probabilities 0.30, 0.25, 0.20, then 25 tokens of 0.01: top_k=3 keeps the first three, min_p=0.75 the
    tokens at least three quarters as likely as the first."""
    probs = torch.tensor([0.30, 0.25, 0.20] + [0.01] * 25)
    settings = GenerationSettings(temperature=1.0, seed=0, **setting)
    generator = settings.make_generator()
    drawn = {next_token(probs.log(), settings, generator) for _ in range(300)}
    assert drawn == allowed
