"""Checking and tokenizing the document a pool is built from.

A document is plain text (also accepted as UTF-8 bytes) or a list of chat messages. Text is
tokenized as it is, with the tokenizer's special tokens (e.g. BOS); messages are rendered with the
model's chat template, which already contains its special tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.model.architecture import document_token_limit
from polykv_agents.prompting.chat_template import Message, has_chat_template, render_messages

Document = str | bytes | Sequence[Message]


def document_text(document: str | bytes) -> str:
    """The document as text: UTF-8 bytes are decoded strictly, and empty text is refused."""
    if isinstance(document, bytes):
        try:
            document = document.decode("utf-8")
        except UnicodeDecodeError as e:
            msg = f"the document is not valid UTF-8 ({e}); convert it to UTF-8 (or, from Python, pass it as str)"
            raise ValueError(msg) from e
    if not document.strip():
        msg = "the document is empty or only whitespace; pass the text the agents should read"
        raise ValueError(msg)
    return document


def _check_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    if not messages:
        msg = "the document messages are empty; pass at least one message with the document text"
        raise ValueError(msg)
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not {"role", "content"} <= set(message):
            msg = f"document message {i} must be a mapping with 'role' and 'content', got {message!r}"
            raise TypeError(msg)
        checked.append({"role": str(message["role"]), "content": str(message["content"])})
    if not any(m["content"].strip() for m in checked):
        msg = "every document message is empty; pass the text the agents should read"
        raise ValueError(msg)
    return checked


def max_positions(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's positions cover, if its config says."""
    config = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def tokenize_document(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, document: Document
) -> tuple[torch.Tensor, list[dict[str, str]] | None]:
    """Token ids ``[T]`` of the document, plus its messages when it is a chat prefix.

    Raises:
        ValueError: empty, undecodable, or longer than the model's positions (a sliding window is no limit:
            a pool keeps every token in every layer, and each layer's window is applied by masks).
    """
    if isinstance(document, (str, bytes)):
        text, messages, add_special = document_text(document), None, True
    else:
        messages = _check_messages(document)
        if not has_chat_template(tokenizer):
            msg = "this tokenizer has no chat template; pass the document as plain text instead of messages"
            raise ValueError(msg)
        text, add_special = render_messages(tokenizer, messages), False
    token_ids = tokenizer(text, add_special_tokens=add_special, return_tensors="pt").input_ids[0]  # [T]
    check_fits_model(model, token_ids.numel(), subject="the document is", remedy="shorten or split the document")
    return token_ids, messages


def check_fits_model(
    model: PreTrainedModel, num_tokens: int, *, subject: str, remedy: str, within_window: bool = False
) -> None:
    """Raise ``ValueError`` unless a pool of ``num_tokens`` leaves room in the model's positions for the agents'
    turns (and, ``within_window``, fits the narrowest sliding window); the message reads ``{subject} {num_tokens}
    tokens ...; {remedy}``."""
    limit = max_positions(model)
    if limit is not None and num_tokens >= limit:
        msg = (
            f"{subject} {num_tokens} tokens, but the model covers at most {limit} positions "
            f"and the agents' turns must fit after it; {remedy}"
        )
        raise ValueError(msg)
    window = document_token_limit(model) if within_window else None
    if window is not None and num_tokens > window:
        msg = (
            f"{subject} {num_tokens} tokens, but keys moved and recomputed in place must fit this model's "
            f"sliding-window layers ({window} tokens): the recompute's mask does not apply windows; {remedy}"
        )
        raise ValueError(msg)
