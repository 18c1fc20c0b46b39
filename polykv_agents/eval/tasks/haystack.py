"""Filler text of a given token length with sentences ("needles") hidden at random depths, as RULER builds its
haystacks; the filler is real prose present on every machine (CPython's ``pydoc_data.topics``), never a
download.

Lengths are counted with the model's own tokenizer: a ``context_tokens`` document is within a few tokens of that
length (the joints between sentences tokenize a little differently from the sentences alone).
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Sequence
from functools import cached_property

from transformers import PreTrainedTokenizerBase

from polykv_agents.eval.corpus import pydoc_documents

_SENTENCE_END = re.compile(r"(?<=[.!?:])\s+")


class Haystack:
    """The corpus split into sentences, each with its token count, for filling documents to a length."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        corpus = text if text is not None else "\n\n".join(pydoc_documents(1, chars_per_document=400_000))
        # Whitespace inside a sentence is collapsed: code listings become one line, like the rest.
        self.sentences = [" ".join(s.split()) for s in _SENTENCE_END.split(corpus) if s.strip()]

    @cached_property
    def _counts(self) -> list[int]:
        """Tokens of each sentence, with the space that joins it to the next."""
        return [len(ids) + 1 for ids in self.tokenizer(self.sentences, add_special_tokens=False).input_ids]

    @cached_property
    def _total(self) -> int:
        return sum(self._counts)

    def tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def filler(self, budget: int, rng: random.Random) -> list[str]:
        """Consecutive sentences from a random start (wrapping around) holding about ``budget`` tokens; the last
        one cut after as many words as still fit, as RULER cuts its haystack to the length."""
        counts = self._counts
        if budget >= self._total:
            msg = f"the filler corpus holds about {self._total} tokens, fewer than the {budget} asked for"
            raise ValueError(msg)
        index, taken, chosen = rng.randrange(len(counts)), 0, []
        while taken + counts[index] <= budget:
            chosen.append(self.sentences[index])
            taken += counts[index]
            index = (index + 1) % len(counts)
        words = self.sentences[index].split()
        fitting = bisect.bisect_right(range(len(words) + 1), budget - taken, key=self._cost_of(words)) - 1
        if fitting > 0:
            chosen.append(" ".join(words[:fitting]))
        return chosen

    def _cost_of(self, words: list[str]):
        """Tokens (with the joining space) of the first ``n`` of ``words``, as a function of ``n``."""
        return lambda n: self.tokens(" ".join(words[:n])) + 1 if n else 0

    def document(self, needles: Sequence[str], context_tokens: int, rng: random.Random) -> str:
        """About ``context_tokens`` tokens of filler with ``needles`` inserted in their order at random depths
        (between sentences; several may share one)."""
        budget = context_tokens - sum(self.tokens(needle) + 1 for needle in needles)
        if budget < 1:
            msg = f"{context_tokens} tokens cannot hold the needles ({context_tokens - budget} tokens)"
            raise ValueError(msg)
        sentences = self.filler(budget, rng)
        depths = sorted(rng.randrange(len(sentences) + 1) for _ in needles)
        for inserted, (depth, needle) in enumerate(zip(depths, needles, strict=True)):
            sentences.insert(depth + inserted, needle)
        return " ".join(sentences)
