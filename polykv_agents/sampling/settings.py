"""Decoding settings and the pure per-step pieces: choosing the next token.

``GenerationSettings`` is validated once per call; ``next_token`` turns one position's logits
``[vocab]`` into a token id (greedy at temperature 0, else temperature + nucleus sampling from a
seeded generator, so a seed reproduces a sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.sampling.grammar import TokenConstraint


class GenerationSettings(BaseModel):
    """How one agent call decodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(default=256, ge=0)
    """Upper bound on generated tokens; 0 returns an empty answer without running the model."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0 means greedy decoding (deterministic)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``."""
    seed: int | None = None
    """Seed of the sampling generator; ``None`` draws one from torch's global generator."""
    stop: tuple[str, ...] = ()
    """Stop sequences (may span several tokens); the answer ends before the first one."""
    ignore_eos: bool = False
    """Keep decoding past end-of-turn tokens (benchmarks use it to decode exactly max_new_tokens)."""
    grammar: str | None = None
    """An llguidance grammar every token must follow (:func:`polykv_agents.sampling.grammar.json_schema_grammar`).
    The answer then ends when the grammar is complete, and stop sequences are not applied: one that
    occurs inside a JSON string must not cut the JSON."""
    structured_opening: str | None = None
    """For a grammar that also admits a plain-text answer (tools with ``tool_choice="auto"``): the text that
    opens its structured answer instead (``<tool_call>``). Stop sequences then apply to a plain-text answer,
    and still never to the structured one."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, value: object) -> object:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        return value

    @model_validator(mode="after")
    def _grammar_ends_the_answer(self) -> GenerationSettings:
        if self.grammar is not None and self.ignore_eos:
            msg = "ignore_eos cannot be combined with a grammar: the grammar decides where the answer ends"
            raise ValueError(msg)
        if self.structured_opening is not None and (self.grammar is None or not self.structured_opening):
            msg = "structured_opening needs a grammar, and must be the non-empty text its structured answer opens with"
            raise ValueError(msg)
        return self

    @property
    def text_stops(self) -> tuple[str, ...]:
        """The stop sequences that apply to the answer's text: none under a grammar, unless it admits plain text."""
        return self.stop if self.grammar is None or self.structured_opening is not None else ()

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):
            msg = "stop sequences must be non-empty strings; remove the empty string from `stop`"
            raise ValueError(msg)
        return value

    def make_generator(self) -> torch.Generator | None:
        """A CPU generator for sampling, or ``None`` for greedy decoding."""
        if self.temperature == 0.0:
            return None
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def next_token(
    logits: torch.Tensor,
    settings: GenerationSettings,
    generator: torch.Generator | None,
    constraint: TokenConstraint | None = None,
) -> int:
    """Pick the next token from ``logits [vocab]``; with a ``constraint``, only among the tokens its
    grammar allows (the logits are masked in place)."""
    if constraint is not None:
        constraint.mask_(logits)
    if settings.temperature == 0.0 or generator is None:
        return int(logits.argmax())
    # Shift by the max first: dividing raw logits by a tiny temperature would overflow to inf/NaN.
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / settings.temperature, dim=-1).cpu()
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token if the mass *before* it is still below top_p (so the top token always stays).
        keep = (sorted_probs.cumsum(0) - sorted_probs) < settings.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class GenerationStats:
    """What one call used, filled in as it runs (the chat model's usage metadata)."""

    prompt_tokens: int
    """New tokens run through the model for this call (role prompt, question, ...)."""
    cached_tokens: int
    """Tokens served from the pool instead of being prefilled again."""
    output_tokens: int = 0
    finish_reason: Literal["stop", "length"] | None = None
    """``stop``: EOS or a stop sequence; ``length``: the token budget ran out."""


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends a turn: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return frozenset(ids)


def token_constraint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: GenerationSettings
) -> TokenConstraint | None:
    """The grammar state of one call, or ``None`` when its settings have no grammar (it then pays nothing)."""
    if settings.grammar is None:
        return None
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    return TokenConstraint(settings.grammar, tokenizer, vocab_size, eos_token_ids(model, tokenizer))


def choose_token(
    logits: torch.Tensor,
    settings: GenerationSettings,
    generator: torch.Generator | None,
    constraint: TokenConstraint | None,
    eos_ids: frozenset[int],
) -> tuple[int | None, Literal["stop"] | None]:
    """One decode step's outcome, shared by the batched scheduler and the private loop:
    ``(token to deliver or None, "stop" when the answer ends here or None)``. EOS ends the answer
    (unless ignored) and is not delivered; a grammar that is complete ends it after its last token."""
    token = next_token(logits, settings, generator, constraint)
    if token in eos_ids and not settings.ignore_eos:
        return None, "stop"
    if constraint is not None:
        constraint.advance(token)
        if constraint.finished:
            return token, "stop"
    return token, None
