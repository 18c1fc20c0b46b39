"""PooledAgent: answers questions from a SharedKVPool without re-reading the document.

One call:
  role prompt + question -> chat-template continuation of the pool's prefix -> suffix ids ``[n]``
  -> a fresh cache of the agent's own, seeded from the decoded pool -> forward the suffix at
  positions ``T .. T+n-1`` -> decode one token at a time -> text pieces, ending at EOS, at
  ``max_new_tokens`` or before the first stop sequence.

The pool is only read: every call decodes it into a cache owned by that call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.compat import forward_with_cache
from polykv_agents.documents import max_positions
from polykv_agents.generation import GenerationSettings, next_token
from polykv_agents.pool import SharedKVPool, check_causal_lm
from polykv_agents.prompts import agent_turns, render_continuation
from polykv_agents.text_stream import StopAwareDetokenizer

logger = logging.getLogger(__name__)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return frozenset(ids)


class PooledAgent:
    """An agent with a role prompt that generates from a shared pool.

    Args:
        pool: The document's pool.
        model: The model the pool was built with (checked against the pool's fingerprint).
        tokenizer: Its tokenizer.
        system_prompt: The agent's role prompt, sent as a system message after the pool's prefix.
        name: A label for logs and reports.
    """

    def __init__(
        self,
        pool: SharedKVPool,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        system_prompt: str | None = None,
        name: str | None = None,
    ) -> None:
        check_causal_lm(model)
        pool.check_compatible(model, tokenizer)
        self.pool = pool
        self.model = model
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.name = name or "agent"
        self._eos_ids = _eos_token_ids(model, tokenizer)
        self._max_positions = max_positions(model)

    def __repr__(self) -> str:
        return f"PooledAgent(name={self.name!r}, pool={self.pool.digest[:12]})"

    def prompt_ids(self, question: str) -> torch.Tensor:
        """Token ids ``[n]`` of the agent's turns that follow the pool's prefix."""
        if not isinstance(question, str) or not question.strip():
            msg = "the question is empty; pass the text the agent should answer"
            raise ValueError(msg)
        text = render_continuation(self.tokenizer, self.pool.prefix_messages, agent_turns(self.system_prompt, question))
        return self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, cache, start_position: int) -> torch.Tensor:
        logits = forward_with_cache(
            self.model,
            ids.to(self.model.device).unsqueeze(0),
            cache,
            start_position=start_position,
            logits_to_keep=1,
        )
        return logits[0, -1]  # [vocab]

    def generate_ids(self, question: str, settings: GenerationSettings | None = None) -> Iterator[int]:
        """Generated token ids, one at a time (EOS excluded). Stop sequences are applied on text,
        by :meth:`stream`/:meth:`generate`, not here."""
        settings = settings or GenerationSettings()
        suffix = self.prompt_ids(question)  # [n]
        start = self.pool.num_tokens
        if self._max_positions is not None and start + suffix.numel() >= self._max_positions:
            msg = (
                f"the pool ({start} tokens) plus this prompt ({suffix.numel()} tokens) exceeds the model's "
                f"{self._max_positions} positions; use a shorter document or question"
            )
            raise ValueError(msg)
        if settings.max_new_tokens == 0:
            return
        budget = settings.max_new_tokens
        if self._max_positions is not None:
            budget = min(budget, self._max_positions - start - suffix.numel())
        generator = settings.make_generator()
        with torch.inference_mode():
            cache = self.pool.to_cache(self.model)  # this call's own cache; the pool is never written
        logits = self._forward(suffix, cache, start)
        position = start + suffix.numel()
        for step in range(budget):
            token = next_token(logits, settings, generator)
            if token in self._eos_ids:
                return
            yield token
            if step + 1 < budget:
                logits = self._forward(torch.tensor([token]), cache, position)
                position += 1

    def stream(
        self,
        question: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
    ) -> Iterator[str]:
        """Yield the answer as text pieces as they are decoded.

        Args:
            question: The user turn.
            max_new_tokens: Upper bound on generated tokens.
            temperature: 0 for greedy decoding.
            top_p: Nucleus sampling mass.
            seed: Sampling seed (reproducible samples).
            stop: Stop sequences; the answer ends before the first one.
        """
        settings = GenerationSettings(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop
        )
        detokenizer = StopAwareDetokenizer(self.tokenizer, settings.stop)
        tokens = self.generate_ids(question, settings)
        try:
            for token in tokens:
                piece = detokenizer.push(token)
                if piece:
                    yield piece
                if detokenizer.stopped:
                    return
            tail = detokenizer.finish()
            if tail:
                yield tail
        finally:
            tokens.close()  # frees the call's cache at once when the consumer stops early

    def generate(self, question: str, **kwargs) -> str:
        """The whole answer; same arguments as :meth:`stream`."""
        return "".join(self.stream(question, **kwargs))
