"""What identifies a model for a pool: a pool's KV tensors only mean something to the model (and
tokenizer) that produced them, so every pool records a fingerprint and every reader checks it."""

from __future__ import annotations

import hashlib

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


def model_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ModelFingerprint:
    """Fingerprint ``model`` + ``tokenizer``."""
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
