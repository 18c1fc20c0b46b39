"""Grammar-constrained decoding: every generated token is one the grammar allows, so the text always
parses (a JSON schema, a tool call).

The engine is llguidance (the grammar library behind vLLM's and SGLang's ``guidance`` backends and
llama.cpp's): a 3 MB wheel with no dependencies, that computes a token mask from a JSON schema or a
Lark grammar; with the unpacking below, masking costs 0.2–0.5 ms per token for SmolLM2's 49k vocabulary
on a 2-core CPU (benchmarks/results/grammar_overhead.md). xgrammar was the other candidate; on Linux it
requires triton (a 286 MB wheel), which a CPU laptop install should not pay for.

Data flow of one constrained call:
  JSON schema -> :func:`json_schema_grammar` (checked at bind time: a schema that cannot be compiled
  is a :class:`GrammarError` then, not mid-generation; each call builds its own matcher from it, 0.4 ms
  for a JSON schema, 1.8 ms for two tools)
  -> ``GenerationSettings.grammar`` (a string, so settings stay frozen and serializable)
  -> per call, a :class:`TokenConstraint` (one llguidance matcher: the call's own grammar state)
  -> each step: ``mask_(logits)`` sets disallowed tokens to -inf before the token is chosen,
     ``advance(token)`` moves the grammar on; ``finished`` once the grammar allows nothing more.
Calls without a grammar have no constraint and pay nothing.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

from polykv_agents.sampling.grammar_closing import (
    CLOSING_MARGIN,
    CLOSING_WINDOW,
    JsonScanner,
    TokenTexts,
    allowed_tokens,
    closing_walk,
)


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled, or an output the grammar cannot continue."""


def json_schema_grammar(schema: Mapping[str, Any] | str) -> str:
    """The llguidance grammar of JSON documents matching ``schema`` (a dict or its JSON text), compact
    (no free whitespace: a small model would otherwise spend its tokens on it).

    Raises:
        GrammarError: ``schema`` is not valid JSON Schema as llguidance reads it; the message says what.
    """
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        msg = f"this JSON schema cannot be compiled into a grammar: {e}"
        raise GrammarError(msg) from e
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        msg = f"this JSON schema cannot be compiled into a grammar: {problem}; fix the schema"
        raise GrammarError(msg)
    return grammar


ANY_JSON_OBJECT = {"type": "object"}
"""The schema of ``json_mode``: any JSON object."""


# tokenizer -> vocabulary size -> llguidance tokenizer (building one reads the whole vocabulary: ~0.3 s).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Iterable[int]):
    key = (vocab_size, tuple(sorted(eos_ids)))
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in cached:
            cached[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(key[1]) or None)
        return cached[key]


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its properties
    and says nothing about others (as OpenAI's strict mode does): otherwise a small model may add keys
    without end. Only schema positions are visited (property schemas, items, anyOf/oneOf, $defs), never
    data such as defaults or enum values; ``allOf`` members are left open, since closing each one would
    make their combination unsatisfiable."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    if isinstance(closed.get("properties"), dict):
        closed["properties"] = {name: closed_schema(sub) for name, sub in closed["properties"].items()}
        closed.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "not", "contains"):
        if isinstance(closed.get(key), dict):
            closed[key] = closed_schema(closed[key])
    for key in ("anyOf", "oneOf", "prefixItems"):
        if isinstance(closed.get(key), list):
            closed[key] = [closed_schema(sub) for sub in closed[key]]
    for key in ("$defs", "definitions"):
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_schema(sub) for name, sub in closed[key].items()}
    return closed


class TokenConstraint:
    """One call's grammar state over a model's logits.

    Args:
        grammar: An llguidance grammar (e.g. from :func:`json_schema_grammar`).
        tokenizer: The model's tokenizer.
        vocab_size: Width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_ids: Tokens that end a turn; the grammar allows them once its text is complete.
    """

    def __init__(
        self, grammar: str, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Iterable[int]
    ) -> None:
        self._matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, vocab_size, eos_ids), grammar, log_level=0)
        self._check()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._scanner = JsonScanner()  # whether the text so far ends inside a string (the closing walk asks)
        self.closing = False
        """Whether this call's tokens are now chosen to close the grammar within the budget (not sampled)."""
        self._closing_window: int | None = None  # tokens left from which each step plans how to close
        words = (vocab_size + 31) // 32
        self._bitmask = torch.full((1, words), -1, dtype=torch.int32)  # [1, ceil(V / 32)], bit set = allowed

    def _check(self) -> None:
        if self._matcher.is_error():
            msg = f"constrained decoding failed: {self._matcher.get_error()}"
            raise GrammarError(msg)

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits ``[vocab]`` of every token the grammar does not allow next to -inf, in place.

        The bits are unpacked with numpy (:func:`~polykv_agents.sampling.grammar_closing.allowed_tokens`), not
        with llguidance's helpers: its torch one is a ``torch.compile`` kernel (a C++ compiler at run time; it
        refuses bf16 or CUDA inference tensors), and its numpy one
        masks numpy logits only. numpy's ``unpackbits`` then gives a boolean mask for logits of any dtype and
        device, and was faster on the decode thread than unpacking with torch shifts, which this replaced
        (benchmarks/results/grammar_overhead.md has the per-token cost of the whole mask).
        """
        allowed = allowed_tokens(self._matcher, self._vocab_size, self._bitmask)  # [V]
        self._check()
        disallowed = torch.from_numpy(~allowed).to(logits.device)
        with torch.inference_mode():  # the logits are inference tensors of the forward pass
            logits.masked_fill_(disallowed, float("-inf"))
        return logits

    def advance(self, token: int) -> None:
        """Move the grammar past ``token`` (one the mask allowed)."""
        if not self._matcher.consume_token(token):
            self._check()
            msg = f"constrained decoding failed: the grammar does not allow token {token} here"
            raise GrammarError(msg)
        self._scanner.feed(self._texts.text[token])

    @functools.cached_property
    def _texts(self) -> TokenTexts:
        """The tokenizer's token texts (decoded once per tokenizer, shared by its calls)."""
        return TokenTexts.of(self._tokenizer, self._vocab_size)

    def closing_token(self, remaining: int) -> int | None:
        """The token to write next so that the grammar is complete within ``remaining`` tokens, or ``None`` to
        sample as usual (:mod:`polykv_agents.sampling.grammar_closing`). Once it has returned a token, it keeps
        returning the closing walk's tokens, then an end-of-turn token."""
        if self._matcher.is_stopped():
            return None
        texts = self._texts
        if self._closing_window is None:  # the first step: how long the shortest output is sets when to look
            shortest = closing_walk(self._matcher, self._scanner, texts, limit=remaining)
            self._closing_window = CLOSING_WINDOW + (remaining if shortest is None else len(shortest))
        if remaining > self._closing_window:
            return None
        walk = closing_walk(self._matcher, self._scanner, texts, limit=remaining)
        if walk is None:
            return None  # no way out within the budget: the answer will be cut, as without closing
        if not walk:  # the grammar may end here: end the answer if closing, else let the model choose
            return self._eos_ids[0] if self.closing and self._eos_ids else None
        if self.closing or len(walk) + CLOSING_MARGIN >= remaining:
            self.closing = True
            return walk[0]
        return None

    @property
    def finished(self) -> bool:
        """The grammar allows no more tokens: the output is complete."""
        return self._matcher.is_stopped()
