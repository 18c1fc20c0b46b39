"""What one scheduler reuses across calls: the start a new call reads, and what a finished call leaves.

  a new call     :meth:`CallReuse.start`: the longest start of its prompt that earlier calls stored in this pool's
                 prefix tree (exact), extended by blocks moved from earlier calls when it asks for
                 ``reuse="blocks"`` (:func:`~polykv_agents.runtime.block_reuse.compose_start`); its admission
                 loads that start into its row and prefills only the rest
  a row that ends :meth:`CallReuse.remember`: the keys and values ``[KVH, tokens, D]`` per layer of what the row ran
                 through the model (its prompt and all but its last generated token), its exact part only, go to
                 the prefix tree and the block store

Both stores belong to the engine (:class:`~polykv_agents.runtime.scheduler_table.SchedulerTable`) and outlive the
scheduler; they are keyed by model and pool digest, so this object only knows which pool its scheduler reads.
"""

from __future__ import annotations

import logging

from transformers import PreTrainedModel

from polykv_agents.model.architecture import document_token_limit
from polykv_agents.model.rope import rotary_embedding
from polykv_agents.runtime.block_reuse import ComposedStart, compose_start
from polykv_agents.runtime.block_store import BlockStore
from polykv_agents.runtime.prefix_tree import PrefixMatch, PrefixTrees
from polykv_agents.runtime.scheduled_request import ScheduledRequest
from polykv_agents.runtime.shared_prefix import SharedPrefix
from polykv_agents.runtime.suffix_cache import SuffixCache
from polykv_agents.sampling.settings import GenerationSettings

logger = logging.getLogger(__name__)


class CallReuse:
    """One scheduler's view of the stored calls over its pool.

    Args:
        model: The model (stores are keyed by it).
        prefix: The scheduler's shared prefix (its pool's digest and length).
        prefixes: Where finished calls leave their tokens' keys and values and new calls look for their longest
            stored start (exact reuse); ``None``: none.
        blocks: The same, for calls that read it at other positions (``reuse="blocks"``); ``None``: none kept.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        prefix: SharedPrefix,
        prefixes: PrefixTrees | None,
        blocks: BlockStore | None,
    ) -> None:
        self.model = model
        self.prefix = prefix
        self.prefixes = prefixes
        self.blocks = blocks

    def check(self, settings: GenerationSettings) -> None:
        """Refuse, before any work, a call whose ``reuse`` this scheduler cannot serve.

        Raises:
            ValueError: ``reuse="blocks"`` without a block store, or on a model whose keys cannot be moved.
        """
        if settings.reuse != "blocks":
            return
        if self.blocks is None:
            msg = (
                "reuse='blocks' reads text that earlier calls left, and this engine keeps none; make the engine "
                "with a budget for it, Engine(max_block_bytes=64 * 1024**2), or call with reuse='exact'"
            )
            raise ValueError(msg)
        rotary_embedding(self.model)  # a model whose keys cannot move is refused here

    def start(self, request: ScheduledRequest) -> PrefixMatch | ComposedStart:
        """The start ``request``'s admission loads instead of prefilling (empty when nothing is stored)."""
        return self._composed_start(request, self._stored_start(request))

    def remember(self, request: ScheduledRequest, cache: SuffixCache, row: int) -> None:
        """Store what row ``row`` of ``cache`` ran through the model (``request``'s prompt and the tokens it
        generated, but for the last one, which no forward has read yet) for later calls to reuse: in the prefix
        tree and as a block, its exact part only (never keys and values composed from moved blocks)."""
        if self.prefixes is None and self.blocks is None:
            return
        start, end = int(cache.starts[row]), int(cache.lengths[row])
        if request.exact_length is not None:
            end = min(end, start + request.exact_length)
        if end <= start or not cache.layers[0].is_initialized:
            return
        layers = [(layer.keys[row, :, start:end], layer.values[row, :, start:end]) for layer in cache.layers]
        tokens = request.tokens[: end - start]
        if self.prefixes is not None:
            self.prefixes.insert(self.model, self.prefix.pool.digest, tokens, layers)
        if self.blocks is not None:
            self.blocks.add(self.model, self.prefix.pool.digest, tokens, layers)

    def _stored_start(self, request: ScheduledRequest) -> PrefixMatch:
        """The longest start of ``request``'s prompt stored by earlier calls (never all of it: its last token
        must run through the model for the first token's logits)."""
        if self.prefixes is None:
            return PrefixMatch()
        return self.prefixes.match(self.model, self.prefix.pool.digest, request.tokens, request.prompt_ids.numel() - 1)

    def _composed_start(self, request: ScheduledRequest, match: PrefixMatch) -> PrefixMatch | ComposedStart:
        """``match``, extended by blocks moved from earlier calls (``reuse="blocks"``) when its prompt holds any
        after it (:mod:`.block_reuse`); ``match`` as it is otherwise."""
        if self.blocks is None or request.settings.reuse != "blocks":
            return match
        last = request.prompt_ids.numel() - 1  # the last prompt token runs through the model: never moved
        limit = document_token_limit(self.model)
        if limit is not None:  # a sliding window must hold the composed start whole (the pool is held whole)
            last = min(last, limit - self.prefix.num_tokens)
        digest = self.prefix.pool.digest
        occurrences = self.blocks.find(self.model, digest, request.tokens, match.length, last)
        if not occurrences:
            return match
        tokens = request.tokens[: occurrences[-1].start + occurrences[-1].length]
        try:
            return compose_start(self.model, self.prefix, match, tokens, occurrences, request.settings.block_recompute)
        except Exception:  # composing is an optimisation: the call prefills instead, which is never wrong
            logger.exception("composing moved blocks failed; the call prefills its prompt instead")
            return match
