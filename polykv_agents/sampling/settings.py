"""Decoding settings and the pure per-step pieces: choosing the next token.

``GenerationSettings`` is validated once per call; ``next_token`` turns one position's logits
``[vocab]`` into a token id: a repetition penalty first (if set), then greedy at temperature 0, else
temperature, top-k, min-p and nucleus (top-p) filtering and a draw from a seeded generator, so a seed
reproduces a sample. The order is transformers' (penalty, temperature, top-k, top-p, min-p): the same
settings mean the same thing as in ``model.generate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.sampling.grammar import TokenConstraint
from polykv_agents.sampling.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprob

DEFAULT_BLOCK_RECOMPUTE = 0.15
"""Fraction of each moved block recomputed under ``reuse="blocks"`` by default (CacheBlend's 15%)."""


class GenerationSettings(BaseModel):
    """How one agent call decodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(default=256, ge=0)
    """Upper bound on generated tokens; 0 returns an empty answer without running the model."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0 means greedy decoding (deterministic)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: int = Field(default=0, ge=0)
    """Sample among the ``top_k`` most likely tokens only; 0 keeps them all."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Drop tokens less likely than ``min_p`` times the most likely one; 0 keeps them all."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """transformers' repetition penalty (CTRL's): the logit of every token already in this call's prompt or
    answer is divided by it when positive, multiplied when negative; 1 leaves logits alone. It applies to
    greedy decoding too. The pooled document is not counted: it is shared by every agent, and penalizing its
    words would push answers away from the document they are about."""
    seed: int | None = None
    """Seed of the sampling generator; ``None`` draws one from torch's global generator."""
    close_grammar: bool = True
    """Under a grammar, write the shortest way to complete it when the budget is about to run out, so the output
    parses (:mod:`polykv_agents.sampling.grammar_closing`); ``False``: sample to the end and let it be cut."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Report each chosen token's log-probability (:mod:`polykv_agents.sampling.logprobs`) and the ``logprobs``
    most likely alternatives' (0: none); ``None``: report nothing (and compute nothing)."""
    stop: tuple[str, ...] = ()
    """Stop sequences (may span several tokens); the answer ends before the first one."""
    ignore_eos: bool = False
    """Keep decoding past end-of-turn tokens (benchmarks use it to decode exactly max_new_tokens)."""
    grammar: str | None = None
    """An llguidance grammar every token must follow (:func:`polykv_agents.sampling.grammar.json_schema_grammar`).
    The answer then ends when the grammar is complete, and stop sequences are not applied: one that
    occurs inside a JSON string must not cut the JSON."""
    reuse: Literal["exact", "blocks"] = "exact"
    """What this call reads from earlier calls over its pool besides the pool: ``exact``, the longest start of its
    prompt that an earlier call ran through the model (the same tokens at the same positions: exact);
    ``blocks``, also text that earlier calls ran through the model anywhere in its prompt (the specialists'
    findings in a critic's prompt), moved to where it now sits and partly recomputed
    (:mod:`polykv_agents.runtime.block_store`). That is an approximation: see the docs for what it costs."""
    block_recompute: float = Field(default=DEFAULT_BLOCK_RECOMPUTE, ge=0.0, le=1.0)
    """Under ``reuse="blocks"``: the fraction of each moved block (its first tokens) recomputed in this call's
    context; ``1.0`` recomputes them all (a full prefill in pieces)."""
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


def repetition_history(settings: GenerationSettings, prompt_ids: torch.Tensor) -> set[int] | None:
    """The token ids a repetition penalty looks at, starting with the prompt's (``None``: no penalty, nothing
    to track); :func:`choose_token` adds each token it chooses."""
    if settings.repetition_penalty == 1.0:
        return None
    return set(prompt_ids.tolist())


def penalize_repetitions(logits: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` on ``logits [vocab]``: a new tensor (the runtime's
    logits are inference tensors, which cannot be changed in place outside inference mode)."""
    ids = torch.tensor(sorted(seen), dtype=torch.long, device=logits.device)
    ids = ids[ids < logits.shape[-1]]
    chosen = logits[ids]
    return logits.index_put((ids,), torch.where(chosen > 0, chosen / penalty, chosen * penalty))


def next_token(
    logits: torch.Tensor,
    settings: GenerationSettings,
    generator: torch.Generator | None,
    constraint: TokenConstraint | None = None,
    history: set[int] | None = None,
) -> int:
    """Pick the next token from ``logits [vocab]``; with a ``constraint``, only among the tokens its
    grammar allows (it masks the logits in place), and with a ``history``, after the repetition penalty."""
    if constraint is not None:
        constraint.mask_(logits)
    if history:
        logits = penalize_repetitions(logits, history, settings.repetition_penalty)
    if settings.temperature == 0.0 or generator is None:
        return int(logits.argmax())
    # Shift by the max first: dividing raw logits by a tiny temperature would overflow to inf/NaN.
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / settings.temperature, dim=-1).cpu()
    if 0 < settings.top_k < probs.numel():
        threshold = probs.topk(settings.top_k).values[-1]
        probs = torch.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum()  # top-p reads the mass of what top-k kept
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token if the mass *before* it is still below top_p (so the top token always stays).
        keep = (sorted_probs.cumsum(0) - sorted_probs) < settings.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    if settings.min_p > 0.0:
        probs = torch.where(probs >= settings.min_p * probs.max(), probs, 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class GenerationStats:
    """What one call used and when, filled in as it runs (the chat model's usage and response metadata)."""

    prompt_tokens: int
    """New tokens run through the model for this call (role prompt, question, ...)."""
    cached_tokens: int
    """Tokens served from the pool instead of being prefilled again."""
    reused_tokens: int = 0
    """Of ``prompt_tokens``, how many were read from an earlier call's keys and values over the same pool
    (:mod:`polykv_agents.runtime.prefix_tree`) instead of being prefilled."""
    block_tokens: int = 0
    """Of ``reused_tokens``, how many were moved from text earlier calls ran through the model at other positions
    (``reuse="blocks"``), rather than read at the same positions (exact)."""
    evicted_tokens: int = 0
    """Of ``prompt_tokens``, how many were stored for reuse once but had been evicted, so were prefilled again."""
    output_tokens: int = 0
    finish_reason: Literal["stop", "length"] | None = None
    """``stop``: EOS or a stop sequence; ``length``: the token budget ran out."""
    created_at: float = field(default_factory=time.monotonic)
    """When the call was made (``time.monotonic``), as are the times below."""
    started_at: float | None = None
    """When the runtime began its prompt (a batch row was free, or the compute thread took it)."""
    first_token_at: float | None = None
    finished_at: float | None = None
    logprobs: list[TokenLogprob] | None = None
    """The delivered tokens' log-probabilities, in order, when the settings ask for them; else ``None``."""
    grammar_closed: bool = False
    """The grammar was closed to fit the budget (:attr:`GenerationSettings.close_grammar`): the output parses,
    but its last tokens were chosen to complete it, not sampled."""

    def seconds(self) -> dict[str, float | None]:
        """Where the call's time went: ``queue_s`` (waiting for a row), ``prefill_s`` (its prompt, to the first
        token), ``decode_s`` (the other tokens); ``None`` for a stage it did not reach."""

        def between(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else end - start

        return {
            "queue_s": between(self.created_at, self.started_at),
            "prefill_s": between(self.started_at, self.first_token_at),
            "decode_s": between(self.first_token_at, self.finished_at),
        }


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
    history: set[int] | None = None,
    logprobs: list[TokenLogprob] | None = None,
    remaining: int | None = None,
) -> tuple[int | None, Literal["stop"] | None]:
    """One decode step's outcome, shared by the batched scheduler and the private loop:
    ``(token to deliver or None, "stop" when the answer ends here or None)``. EOS ends the answer
    (unless ignored) and is not delivered; a grammar that is complete ends it after its last token.
    The chosen token joins ``history`` (:func:`repetition_history`); a delivered token's log-probability under
    ``logits`` (the model's, before any processing) is appended to ``logprobs`` when given. With ``remaining``
    (the tokens left in the budget, this one included) a grammar is closed in time
    (:attr:`GenerationSettings.close_grammar`).
    """
    # Kept aside before sampling: a grammar masks the logits in place.
    scored = None if logprobs is None else (logits.clone() if constraint is not None else logits)
    closing = None
    if constraint is not None and settings.close_grammar and remaining is not None:
        closing = constraint.closing_token(remaining)  # the budget is nearly spent: complete the grammar
    token = closing if closing is not None else next_token(logits, settings, generator, constraint, history)
    if history is not None:
        history.add(token)
    if token in eos_ids and not settings.ignore_eos:
        return None, "stop"
    if scored is not None and logprobs is not None:
        logprobs.append(token_logprob(scored, token, settings.logprobs or 0))
    if constraint is not None:
        constraint.advance(token)
        if constraint.finished:
            return token, "stop"
    return token, None
