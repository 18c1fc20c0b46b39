"""What identifies a model for a pool: a pool's KV tensors only mean something to the model (and
tokenizer) that produced them, so every pool records a fingerprint and every reader checks it.

The dtype is not part of the identity. A pool holds codes, decoded into whatever dtype the reader
computes in, so the same weights in fp32 and in bf16 are the same model for a pool: the weights hash
is taken over a sample rounded to bf16, which both dtypes give bit for bit. (An fp16 copy rounds its
weights differently and is told apart, with a message that names the dtypes.)"""

from __future__ import annotations

import hashlib
import threading
import weakref

import torch
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.codecs.encoded import dtype_name
from polykv_agents.model.compute_thread import run_on_compute_thread

# Enough of the input embedding to tell two checkpoints of one architecture apart, cheaply.
WEIGHT_SAMPLE_ELEMENTS = 1 << 16

DTYPE_FREE_FIELDS = ("dtype",)
"""Fields recorded for information only, not compared: the dtype of the model that built the pool."""


class ModelFingerprint(BaseModel):
    """Architecture, shapes, name, and short hashes of weights and vocabulary; plus the dtype of the model
    that computed it, recorded but not compared (see the module doc)."""

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
        """Names of the fields that differ, each with both values. ``name`` and ``dtype`` are informational
        only: the same weights under another path, or in another dtype, are the same model."""
        return [
            f"{field}: {getattr(self, field)!r} != {getattr(other, field)!r}"
            for field in type(self).model_fields
            if field not in ("name", *DTYPE_FREE_FIELDS) and getattr(self, field) != getattr(other, field)
        ]


def _text_config(model: PreTrainedModel):
    return model.config.get_text_config(decoder=True)


def _short_sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# model -> tokenizer -> (state the fingerprint was computed from, fingerprint). Hashing the vocabulary
# takes ~90 ms for a 49k-token tokenizer, and every pooled call checks the fingerprint.
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


def _embedding_weights(model: PreTrainedModel) -> torch.Tensor:
    """The input embedding's weights, or the sample of them an int8 embedding kept
    (:class:`~polykv_agents.model.quantized_embedding.Int8Embedding`): a model's fingerprint is the same whichever
    way its weights are stored."""
    embedding = model.get_input_embeddings()
    sample = getattr(embedding, "fingerprint_sample", None)
    return sample if sample is not None else embedding.weight


def _state(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple:
    """What would change the fingerprint: the embedding tensor (its storage and in-place version
    counter), the dtype, the name and the vocabulary size."""
    embedding = _embedding_weights(model)
    return (embedding.data_ptr(), embedding._version, model.dtype, model.config.name_or_path, len(tokenizer))


def model_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ModelFingerprint:
    """Fingerprint ``model`` + ``tokenizer``, memoised while neither changes."""
    state = _state(model, tokenizer)
    with _MEMO_LOCK:
        memo = _MEMO.setdefault(model, weakref.WeakKeyDictionary()).get(tokenizer)
    if memo is not None and memo[0] == state:
        return memo[1]
    fingerprint = run_on_compute_thread(_compute_fingerprint, model, tokenizer)
    with _MEMO_LOCK:
        _MEMO.setdefault(model, weakref.WeakKeyDictionary())[tokenizer] = (state, fingerprint)
    return fingerprint


def _compute_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ModelFingerprint:
    config = _text_config(model)
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    embedding = _embedding_weights(model).detach()
    # Rounded to bf16 first: an fp32 model and its bf16 copy then hash alike.
    sample = embedding.flatten()[:WEIGHT_SAMPLE_ELEMENTS].to("cpu", torch.bfloat16).to(torch.float32).contiguous()
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
    actual = model_fingerprint(model, tokenizer)
    problems = expected.mismatches(actual)
    if not problems:
        return
    if "float16" in (expected.dtype, actual.dtype) and expected.dtype != actual.dtype:
        problems.append(
            f"the pool was built by a {expected.dtype} model and this one is {actual.dtype}: fp16 rounds the weights "
            "differently from fp32 and bf16, so load the model in the pool's dtype"
        )
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    msg = (
        f"This pool was built with model {expected.name!r} and its tokenizer, and cannot be read with {name!r} and "
        f"this tokenizer ({'; '.join(problems)}). Build a new pool with this model and tokenizer, or load the ones "
        "the pool was built with."
    )
    raise ValueError(msg)
