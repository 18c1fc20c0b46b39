"""One call as the runtime sees it: a :class:`DecodeRequest`, made once per call and handed to a backend.

It replaces the argument bundle (model, tokenizer, pool, prompt ids, settings, stats, budget) that used
to be threaded through every layer of the decode path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.pool.documents import max_positions
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.sampling.settings import GenerationSettings, GenerationStats


@dataclass(eq=False)
class DecodeRequest:
    """Everything one call decodes from.

    The call's own tokens ``prompt_ids [n]`` sit at positions ``T .. T+n-1`` after the pool's ``T`` tokens
    (``T = 0`` without a pool); ``stats`` is filled in as the call runs (the chat model's usage metadata).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    prompt_ids: torch.Tensor  # [n]
    settings: GenerationSettings
    pool: SharedKVPool | None = None
    stats: GenerationStats = field(init=False)
    """What the call used, filled in as it runs; made from the prompt and the pool."""

    def __post_init__(self) -> None:
        self.stats = GenerationStats(prompt_tokens=self.prompt_ids.numel(), cached_tokens=self.start_position)
        if self.settings.logprobs is not None:
            self.stats.logprobs = []

    @property
    def start_position(self) -> int:
        """Position of the first prompt token: the pool's length, 0 without a pool."""
        return self.pool.num_tokens if self.pool is not None else 0

    def token_budget(self) -> int:
        """Tokens this call may generate: ``max_new_tokens``, capped by the positions the model has left.

        Raises:
            ValueError: The pool plus the prompt already fill the model's positions.
        """
        limit = max_positions(self.model)
        if limit is None:
            return self.settings.max_new_tokens
        used = self.start_position + self.prompt_ids.numel()
        if used >= limit:
            msg = (
                f"the pool ({self.start_position} tokens) plus this prompt ({self.prompt_ids.numel()} tokens) "
                f"exceeds the model's {limit} positions; use a shorter document or prompt"
            )
            raise ValueError(msg)
        return min(self.settings.max_new_tokens, limit - used)
