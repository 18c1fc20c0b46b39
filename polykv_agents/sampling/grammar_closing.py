"""Closing a grammar before the token budget ends, so structured output and forced tool calls always parse.

A small model can loop inside a JSON string until ``max_tokens`` runs out; its answer then does not parse.
Near the end of the budget (:data:`CLOSING_WINDOW`), each step asks the grammar for a short
way to finish: a greedy walk on a copy of the llguidance matcher that takes the tokens the grammar forces
(``compute_ff_tokens``: a required key, ``</tool_call>``), and otherwise the first allowed of a few closing
tokens (``"`` inside a string; ``]``, ``}``, ``,``, ``0``, ``"``, ... outside one) until the grammar accepts. When
that walk needs nearly all the tokens left (:data:`CLOSING_MARGIN`), the decoder stops sampling and writes
the walk's tokens instead, so the answer is complete when the budget ends. The chat model then reports
``finish_reason="length"`` and ``response_metadata["grammar_closed"] = True``: the output parses, but the
model did not finish it itself (a string may stop mid-sentence, a required value may be a placeholder).

The walk is a heuristic, not a shortest-path search: JSON closes in a mechanical way once the string is
closed, and llguidance forces what a schema requires. Where it cannot close within the tokens left (a budget
too small for the required keys), decoding goes on as without it and the answer is cut as before.
"""

from __future__ import annotations

import threading
import weakref
from typing import ClassVar

import llguidance
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

CLOSING_WINDOW = 32
"""Each step plans how to close once the tokens left are at most this many more than the grammar's shortest
output (walked once, at the call's first step); before that, nothing is computed."""

CLOSING_MARGIN = 2
"""Closing starts when the walk needs more than the tokens left minus this margin: one freely sampled
token can lengthen the way out by more than one (a new ``{"`` needs ``"}`` too)."""

INSIDE_STRING = ('"',)
OUTSIDE_STRING = ("]", "}", ",", "0", '"', "null", "false", "true", "[", "{", ":")
"""Texts the walk prefers, in order, where the grammar forces nothing: close a container, else end the value
(``,`` is allowed only after a complete value; ``0`` before it would lengthen a number forever), else the
shortest value."""


class TokenTexts:
    """A tokenizer's token texts and byte lengths, decoded once per tokenizer (the walk picks tokens by text)."""

    _cache: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        texts = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        self.text = [tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in texts]
        self.text += [""] * (vocab_size - len(self.text))
        self.length = np.array([len(t.encode("utf-8")) for t in self.text])  # [V]
        single = {}
        for token_id, text in enumerate(self.text):
            single.setdefault(text, token_id)  # the first id whose whole text it is
        self.preferred_inside = [single[t] for t in INSIDE_STRING if t in single]
        self.preferred_outside = [single[t] for t in OUTSIDE_STRING if t in single]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> TokenTexts:
        with cls._lock:
            per_size = cls._cache.setdefault(tokenizer, {})
            if vocab_size not in per_size:
                per_size[vocab_size] = cls(tokenizer, vocab_size)
            return per_size[vocab_size]


class JsonScanner:
    """Whether the text so far ends inside a JSON string (escapes followed), fed one token's text at a time."""

    def __init__(self, in_string: bool = False, escaped: bool = False) -> None:
        self.in_string, self.escaped = in_string, escaped

    def copy(self) -> JsonScanner:
        return JsonScanner(self.in_string, self.escaped)

    def feed(self, text: str) -> None:
        for char in text:
            if self.escaped:
                self.escaped = False
            elif char == "\\" and self.in_string:
                self.escaped = True
            elif char == '"':
                self.in_string = not self.in_string


def allowed_tokens(matcher: llguidance.LLMatcher, vocab_size: int, bitmask: torch.Tensor | None = None) -> np.ndarray:
    """``[V]`` bool: the tokens ``matcher`` allows next. ``bitmask`` (``[1, ceil(V / 32)]`` int32) is filled in place;
    ``None``: a new one."""
    if bitmask is None:
        bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    # Bit i of word w allows token 32 * w + i: the words' bytes in little-endian order, each byte's bits low first.
    as_bytes = bitmask.numpy()[0].astype("<i4", copy=False).view(np.uint8)
    return np.unpackbits(as_bytes, bitorder="little")[:vocab_size].astype(bool)


def closing_walk(
    matcher: llguidance.LLMatcher, scanner: JsonScanner, texts: TokenTexts, limit: int
) -> list[int] | None:
    """Tokens that take ``matcher`` (left untouched) to a state where the grammar may end, at most ``limit`` of
    them; ``None`` if the walk does not get there within ``limit``."""
    walker, scanner = matcher.deep_copy(), scanner.copy()
    vocab_size = len(texts.text)
    tokens: list[int] = []
    while not (walker.is_accepting() or walker.is_stopped()):
        if len(tokens) >= limit or walker.is_error():
            return None
        forced = walker.compute_ff_tokens()
        if forced:
            token = forced[0]
        else:
            allowed = allowed_tokens(walker, vocab_size)
            preferred = texts.preferred_inside if scanner.in_string else texts.preferred_outside
            token = next((t for t in preferred if allowed[t]), None)
            if token is None:  # e.g. inside an enum's string: the longest allowed token finishes it soonest
                candidates = np.flatnonzero(allowed)
                if candidates.size == 0:
                    return None
                token = int(candidates[np.argmax(texts.length[candidates])])
        if not walker.consume_token(token):
            return None
        tokens.append(token)
        scanner.feed(texts.text[token])
    return tokens
