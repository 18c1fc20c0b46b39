"""Log-probabilities in a chat answer: the chat model's ``logprobs``/``top_logprobs`` settings, and the answer's
token log-probabilities in ChatOpenAI's ``response_metadata["logprobs"]`` form.

Each entry holds the token's text and its own bytes. A token can be part of a character (byte-level BPE splits
``€`` into three tokens of one byte each; SentencePiece falls back to ``<0xE2>`` byte tokens): its text is then
U+FFFD, and its bytes are the ones it stands for, so that joining an answer's bytes gives the answer's UTF-8.

  token id -> its vocabulary entry (``convert_ids_to_tokens``)
  -> a byte token ``<0xE2>``: that byte; byte-level BPE: each character mapped back through GPT-2's byte alphabet;
     anything else (added tokens, other tokenizers, whose tokens are whole characters): its text's UTF-8.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from polykv_agents.sampling.logprobs import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""SentencePiece's byte-fallback tokens: one byte each, written as ``<0xE2>``."""


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character a byte is written as -> that byte. Printable
    Latin-1 bytes stand for themselves; the others (controls, space, 0x7F-0xA0, 0xAD) are shifted to U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [byte for byte in range(256) if byte not in printable]
    chars = {byte: chr(byte) for byte in printable} | {byte: chr(256 + i) for i, byte in enumerate(shifted)}
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = _gpt2_byte_alphabet()
"""A constant table (256 entries): what byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) are written in."""


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer``'s vocabulary is written in GPT-2's byte alphabet (its decoder maps it back to bytes)."""
    if getattr(tokenizer, "byte_decoder", None) is not None:  # a Python byte-level tokenizer
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[bytes]:
    """The bytes each of ``token_ids`` stands for: a token that is part of a character gives its own bytes,
    never the UTF-8 of the U+FFFD its text decodes to."""
    byte_level = _is_byte_level(tokenizer)
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))  # special and added tokens are written as text
    result = []
    for token_id, token in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids)), strict=True):
        byte_token = _BYTE_TOKEN.fullmatch(token) if token is not None else None
        if byte_token is not None:
            result.append(bytes([int(byte_token.group(1), 16)]))
        elif byte_level and token_id not in added and token and all(char in _BYTE_OF_CHAR for char in token):
            result.append(bytes(_BYTE_OF_CHAR[char] for char in token))
        else:
            result.append(tokenizer.decode([token_id]).encode("utf-8"))
    return result


def logprobs_setting(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """The runtime's ``logprobs`` setting: ``None`` (off), else how many alternatives to report."""
    if logprobs is None and top_logprobs:  # logprobs=False explicitly (a call turning them off) wins
        msg = f"top_logprobs={top_logprobs} needs logprobs=True"
        raise ValueError(msg)
    if not logprobs:
        return None
    return top_logprobs or 0


def openai_logprobs(logprobs: Sequence[TokenLogprob], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The answer's token log-probabilities as ChatOpenAI's ``response_metadata["logprobs"]`` holds them."""
    ids = sorted({item.token_id for item in logprobs} | {t for item in logprobs for t, _ in item.top})
    bytes_of = dict(zip(ids, token_bytes(tokenizer, ids), strict=True))

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.decode([token_id]), "bytes": list(bytes_of[token_id]), "logprob": logprob}

    content = [
        {**entry(item.token_id, item.logprob), "top_logprobs": [entry(t, lp) for t, lp in item.top]}
        for item in logprobs
    ]
    return {"content": content}
