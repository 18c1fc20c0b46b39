"""PooledAgent: answers questions from a SharedKVPool without re-reading the document.

An agent is a role prompt bound to a pool and a model: its question and role prompt become a
chat-template continuation of the pool's prefix (:mod:`polykv_agents.prompting.encode`), and the engine's
backend generates from there (:mod:`polykv_agents.runtime.generate`). The pool is only read: every call
decodes into caches of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.engine import Engine, default_engine
from polykv_agents.model.architecture import check_causal_lm
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.prompting.chat_template import agent_turns
from polykv_agents.prompting.encode import encode_prompt
from polykv_agents.runtime.backend import Backend, Runtime, check_runtime
from polykv_agents.runtime.generate import generate_text, generate_token_ids
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.sampling.settings import GenerationSettings

logger = logging.getLogger(__name__)


class PooledAgent:
    """An agent with a role prompt that generates from a shared pool.

    Args:
        pool: The document's pool.
        model: The model the pool was built with (checked against the pool's fingerprint).
        tokenizer: Its tokenizer.
        system_prompt: The agent's role prompt, sent as a system message after the pool's prefix.
        name: A label for logs and reports.
        runtime: ``auto`` (default), ``decompressed`` or ``compressed``: concurrent calls over this pool are
            batched over one shared prefix, kept decoded or only as the pool (read as stored by the native
            kernel), ``auto`` picking the faster of the two for this model on this machine
            (:mod:`~polykv_agents.runtime.residency`); ``private``: the reference design, one decoded copy of the
            pool per call.
        engine: Where the batch schedulers live; ``None``: the process-wide default engine.
    """

    def __init__(
        self,
        pool: SharedKVPool,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        system_prompt: str | None = None,
        name: str | None = None,
        runtime: Runtime = "auto",
        engine: Engine | None = None,
    ) -> None:
        check_causal_lm(model)
        pool.check_compatible(model, tokenizer)
        self.pool = pool
        self.model = model
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.name = name or "agent"
        self.runtime: Runtime = check_runtime(runtime)
        self.engine = engine if engine is not None else default_engine()

    def __repr__(self) -> str:
        return f"PooledAgent(name={self.name!r}, pool={self.pool.digest[:12]})"

    def prompt_ids(self, question: str, *, answer_prefix: str | None = None) -> torch.Tensor:
        """Token ids ``[n]`` of the agent's turns that follow the pool's prefix; with ``answer_prefix``, they end
        inside the answer, which starts with that text (a partial assistant turn the model continues)."""
        if not isinstance(question, str) or not question.strip():
            msg = "the question is empty; pass the text the agent should answer"
            raise ValueError(msg)
        turns = agent_turns(self.system_prompt, question)
        if answer_prefix:
            turns.append({"role": "assistant", "content": answer_prefix})
        return encode_prompt(self.tokenizer, turns, prefix_messages=self.pool.prefix_messages)

    def generate_ids(
        self, question: str, settings: GenerationSettings | None = None, *, answer_prefix: str | None = None
    ) -> Iterator[int]:
        """Generated token ids, one at a time (EOS excluded). Stop sequences are applied on text,
        by :meth:`stream`/:meth:`generate`, not here."""
        request = self._request(question, settings or GenerationSettings(), answer_prefix)
        return generate_token_ids(request, self._backend())

    def stream(
        self,
        question: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        answer_prefix: str | None = None,
    ) -> Iterator[str]:
        """Yield the answer as text pieces as they are decoded.

        Args:
            question: The user turn.
            max_new_tokens: Upper bound on generated tokens.
            temperature: 0 for greedy decoding.
            top_p: Nucleus sampling mass.
            seed: Sampling seed (reproducible samples).
            stop: Stop sequences; the answer ends before the first one.
            answer_prefix: Text the answer starts with, continued by the model and not yielded (RULER's answer
                prefixes; a way to steer a base model's format).
        """
        settings = GenerationSettings(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop
        )
        return generate_text(self._request(question, settings, answer_prefix), self._backend())

    def _request(self, question: str, settings: GenerationSettings, answer_prefix: str | None = None) -> DecodeRequest:
        prompt = self.prompt_ids(question, answer_prefix=answer_prefix)
        return DecodeRequest(self.model, self.tokenizer, prompt, settings, pool=self.pool)

    def _backend(self) -> Backend:
        return self.engine.backend(self.runtime)

    def generate(self, question: str, **kwargs) -> str:
        """The whole answer; same arguments as :meth:`stream`."""
        return "".join(self.stream(question, **kwargs))
