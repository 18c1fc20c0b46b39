"""What identifies a model for a pool: a pool's KV tensors only mean something to the model (and
tokenizer) that produced them, so every pool records a fingerprint and every reader checks it."""

from __future__ import annotations

import hashlib
import threading
import weakref

import torch
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.codecs.encoded import dtype_name

# Enough of the input embedding to tell two checkpoints of one architecture apart, cheaply.
_WEIGHT_SAMPLE_ELEMENTS = 1 << 16


class ModelFingerprint(BaseModel):
    """Architecture, shapes, dtype, name, and short hashes of weights and vocabulary."""

    model_config = ConfigDict(frozen=True)

    name: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int
    weights_sha: str
    tokenizer_sha: str

    def mismatches(self, other: ModelFingerprint) -> list[str]:
        """Names of the fields that differ, each with both values. ``name`` is informational only:
        the same weights under another path are the same model."""
        return [
            f"{field}: {getattr(self, field)!r} != {getattr(other, field)!r}"
            for field in type(self).model_fields
            if field != "name" and getattr(self, field) != getattr(other, field)
        ]


def _text_config(model: PreTrainedModel):
    return model.config.get_text_config(decoder=True)


def _short_sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# model -> tokenizer -> (state the fingerprint was computed from, fingerprint). Hashing the vocabulary
# takes ~90 ms for a 49k-token tokenizer, and every pooled call checks the fingerprint.
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


def _state(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple:
    """What would change the fingerprint: the embedding tensor (its storage and in-place version
    counter), the dtype, the name and the vocabulary size."""
    embedding = model.get_input_embeddings().weight
    return (embedding.data_ptr(), embedding._version, model.dtype, model.config.name_or_path, len(tokenizer))


def model_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ModelFingerprint:
    """Fingerprint ``model`` + ``tokenizer``, memoised while neither changes."""
    state = _state(model, tokenizer)
    with _MEMO_LOCK:
        memo = _MEMO.setdefault(model, weakref.WeakKeyDictionary()).get(tokenizer)
    if memo is not None and memo[0] == state:
        return memo[1]
    fingerprint = _compute_fingerprint(model, tokenizer)
    with _MEMO_LOCK:
        _MEMO.setdefault(model, weakref.WeakKeyDictionary())[tokenizer] = (state, fingerprint)
    return fingerprint


def _compute_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ModelFingerprint:
    config = _text_config(model)
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    embedding = model.get_input_embeddings().weight.detach()
    sample = embedding.flatten()[:_WEIGHT_SAMPLE_ELEMENTS].to("cpu", torch.float32).contiguous()
    vocab = sorted(tokenizer.get_vocab().items())
    return ModelFingerprint(
        name=str(getattr(model.config, "name_or_path", "") or type(model).__name__),
        architecture=type(model).__name__,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        dtype=dtype_name(model.dtype),
        vocab_size=len(vocab),
        weights_sha=_short_sha(sample.numpy().tobytes()),
        tokenizer_sha=_short_sha(repr(vocab).encode()),
    )


def check_same_model(expected: ModelFingerprint, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise ``ValueError`` unless ``model`` and ``tokenizer`` have the fingerprint ``expected`` (a pool's)."""
    problems = expected.mismatches(model_fingerprint(model, tokenizer))
    if not problems:
        return
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    msg = (
        f"This pool was built with model {expected.name!r} and its tokenizer, and cannot be read with {name!r} and "
        f"this tokenizer ({'; '.join(problems)}). Build a new pool with this model and tokenizer, or load the ones "
        "the pool was built with."
    )
    raise ValueError(msg)
