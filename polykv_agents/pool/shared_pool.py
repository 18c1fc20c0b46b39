"""SharedKVPool: a document's KV cache, prefilled once, compressed, read by any number of agents.

Data flow of :meth:`SharedKVPool.prefill`:
  document (text, or chat messages rendered with the chat template) -> token ids ``[T]``
  -> chunked model forward into a ``DynamicCache`` (:mod:`polykv_agents.pool.prefill`)
  -> per layer: keys ``[1, kv_heads, T, head_dim]`` through the key codec, values through the
     value codec -> one immutable pool of :class:`EncodedLayer` records.

After construction nothing in a pool is ever written: agents decode layers into caches of their
own, so a pool can be read from many threads at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from pydantic import BaseModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from polykv_agents.codecs import EncodedTensor, TensorCodec, decode
from polykv_agents.config import CodecConfig, CompressionConfig, compression_config
from polykv_agents.model.architecture import check_causal_lm
from polykv_agents.model.compat import cache_from_key_values, layer_key_values
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.model.fingerprint import DTYPE_FREE_FIELDS, ModelFingerprint, check_same_model, model_fingerprint
from polykv_agents.model.heap import release_free_heap
from polykv_agents.model.rope import rope_frequencies
from polykv_agents.pool.documents import Document, tokenize_document
from polykv_agents.pool.memory import MemoryReport
from polykv_agents.pool.prefill import DEFAULT_CHUNK_SIZE, prefill_cache
from polykv_agents.prompting.chat_template import Message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodedLayer:
    """One decoder layer of the pool."""

    keys: EncodedTensor
    values: EncodedTensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def pool_digest(
    fingerprint: ModelFingerprint,
    config: CompressionConfig,
    token_ids: torch.Tensor,
    *,
    chat_prefix: bool,
    composition: Mapping[str, Any] | None = None,
) -> str:
    """Content address of a pool: model fingerprint, config, prefix kind and token ids determine it,
    so it can be computed before (and instead of) a prefill. The model's dtype is left out: a pool holds
    codes, which models of any dtype read (one pool, one digest, for fp32 and bf16 readers). A composed pool
    (``composition``, see :mod:`polykv_agents.pool.compose`) holds approximate keys and values, so its digest
    differs from that of a pool prefilled from the same tokens."""
    header = {
        "fingerprint": fingerprint.model_dump(exclude=set(DTYPE_FREE_FIELDS)),
        "config": config.model_dump(),
        "chat_prefix": chat_prefix,
    }
    if composition is not None:
        header["composition"] = dict(composition)
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(token_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def _encode_layer(
    keys: torch.Tensor, values: torch.Tensor, key_codec, value_codec, key_rope_inv_freq: torch.Tensor | None
) -> tuple[EncodedLayer, int]:
    """One cache layer compressed, and the fp16 bytes it would take (measured on a real fp16 copy).
    ``key_rope_inv_freq``: the layer's rotary frequencies, for a key codec that compresses before RoPE."""
    fp16_nbytes = keys.to(torch.float16).nbytes + values.to(torch.float16).nbytes
    encoded_keys = (
        key_codec.encode(keys) if key_rope_inv_freq is None else key_codec.encode(keys, rope_inv_freq=key_rope_inv_freq)
    )
    layer = EncodedLayer(keys=encoded_keys, values=value_codec.encode(values))
    # The codecs pass each layer through float32 copies several times its size; freed between the small codes
    # every layer keeps, glibc would hold them all in the RSS (:mod:`~polykv_agents.model.heap`).
    release_free_heap()
    return layer, fp16_nbytes


class SharedKVPool:
    """A write-once, read-many compressed KV cache of one document for one model.

    Build one with :meth:`prefill`. All sizes are measured from real tensors: ``nbytes`` sums the
    stored codes, scales and norms; ``fp16_nbytes`` and ``model_dtype_nbytes`` are the ``nbytes``
    of the uncompressed cache the model produced, cast to fp16 and as produced.
    """

    def __init__(
        self,
        *,
        layers: Sequence[EncodedLayer],
        token_ids: torch.Tensor,
        config: CompressionConfig,
        fingerprint: ModelFingerprint,
        prefix_messages: Sequence[Message] | None,
        fp16_nbytes: int,
        model_dtype_nbytes: int,
        composition: Mapping[str, Any] | None = None,
    ) -> None:
        object.__setattr__(self, "_layers", tuple(layers))
        object.__setattr__(self, "_token_ids", token_ids.detach().to("cpu", torch.int64).clone())  # [T]
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "fingerprint", fingerprint)
        object.__setattr__(
            self,
            "prefix_messages",
            None if prefix_messages is None else tuple(MappingProxyType(dict(m)) for m in prefix_messages),
        )
        object.__setattr__(self, "fp16_nbytes", int(fp16_nbytes))
        object.__setattr__(self, "model_dtype_nbytes", int(model_dtype_nbytes))
        object.__setattr__(self, "composition", None if composition is None else MappingProxyType(dict(composition)))
        """How this pool was composed from others' keys and values (:mod:`polykv_agents.pool.compose`); ``None``
        for a pool prefilled from its tokens, whose keys and values are exact before compression."""
        object.__setattr__(self, "digest", self._compute_digest())

    def __setattr__(self, name: str, value: Any) -> None:
        msg = f"SharedKVPool is read-only after it is built (tried to set {name!r}); build a new pool instead."
        raise AttributeError(msg)

    def __repr__(self) -> str:
        return (
            f"SharedKVPool(tokens={self.num_tokens}, layers={self.num_layers}, config='{self.config.label()}', "
            f"nbytes={self.nbytes}, compression_ratio={self.compression_ratio:.2f}x vs fp16, "
            f"digest={self.digest[:12]})"
        )

    # ---------------------------------------------------------------- building

    @classmethod
    def prefill(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        document: Document,
        *,
        config: CompressionConfig | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        progress: Callable[[int, int], None] | None = None,
    ) -> SharedKVPool:
        """Prefill ``document`` once and compress its KV cache.

        Args:
            model: A Hugging Face causal LM (see :func:`polykv_agents.load_model`).
            tokenizer: Its tokenizer.
            document: Plain text, or chat messages (``[{"role": ..., "content": ...}, ...]``) that
                are rendered with the chat template, e.g. a shared system message plus the document.
            config: Compression; ``None`` for the default (int8 keys, 3-bit TurboQuant values).
            chunk_size: Tokens per forward pass during prefill.
            progress: Called as ``progress(tokens_done, tokens_total)`` after each chunk.

        Raises:
            TypeError: ``model`` is not a causal LM.
            ValueError: Empty document, or longer than the model's positions.
        """
        check_causal_lm(model)
        token_ids, prefix_messages = tokenize_document(model, tokenizer, document)  # [T]
        return cls.prefill_tokens(
            model,
            tokenizer,
            token_ids,
            prefix_messages=prefix_messages,
            config=config,
            chunk_size=chunk_size,
            progress=progress,
        )

    @classmethod
    def prefill_tokens(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        token_ids: torch.Tensor,
        *,
        prefix_messages: Sequence[Message] | None = None,
        config: CompressionConfig | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        progress: Callable[[int, int], None] | None = None,
    ) -> SharedKVPool:
        """:meth:`prefill` of a document already tokenized by
        :func:`~polykv_agents.pool.documents.tokenize_document` (``token_ids [T]``, and its messages when
        it is a chat prefix), so that a caller who needed the ids first (for the digest) tokenizes once."""
        config = compression_config(config)
        cache, _ = prefill_cache(model, token_ids, chunk_size=chunk_size, progress=progress)
        return cls.from_cache(model, tokenizer, cache, token_ids, config=config, prefix_messages=prefix_messages)

    @classmethod
    def from_cache(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cache: Cache,
        token_ids: torch.Tensor,
        *,
        config: CompressionConfig | None = None,
        prefix_messages: Sequence[Message] | None = None,
        composition: BaseModel | None = None,
    ) -> SharedKVPool:
        """Compress a full-precision ``cache`` of ``token_ids [T]`` into a pool. The cache is only
        read, so a caller can keep using it (the perplexity evaluation does). ``composition``: how the cache
        was composed from other pools (:class:`~polykv_agents.pool.compose.Composition`), if it was."""
        config = compression_config(config)
        codecs: dict[tuple[CodecConfig, int], TensorCodec] = {}  # one per (config, seed), whatever its layers

        def codec(codec_config: CodecConfig, seed: int) -> TensorCodec:
            if (codec_config, seed) not in codecs:
                codecs[(codec_config, seed)] = codec_config.build(seed=seed)
            return codecs[(codec_config, seed)]

        num_tokens = token_ids.numel()
        cache_layers = list(layer_key_values(cache))
        codecs_by_layer = config.codecs_by_layer(len(cache_layers))
        layers, fp16_nbytes, model_dtype_nbytes = [], 0, 0
        with torch.inference_mode():
            for layer_idx, (keys, values) in enumerate(cache_layers):
                key_config, value_config = codecs_by_layer[layer_idx]
                key_codec = codec(key_config, config.seed)
                value_codec = codec(value_config, config.seed + 1)  # own signs
                if keys.shape[-2] != num_tokens:
                    msg = (
                        f"a cache layer kept {keys.shape[-2]} of the document's {num_tokens} tokens (a "
                        "sliding-window layer shorter than the document); shorten the document below the "
                        "model's sliding window"
                    )
                    raise ValueError(msg)
                model_dtype_nbytes += keys.nbytes + values.nbytes
                # One layer at a time on the compute thread: running agents' steps interleave with it.
                inv_freq = rope_frequencies(model, layer_idx) if getattr(key_config, "before_rope", False) else None
                layer, layer_fp16_nbytes = run_on_compute_thread(
                    _encode_layer, keys, values, key_codec, value_codec, inv_freq
                )
                fp16_nbytes += layer_fp16_nbytes
                layers.append(layer)
        pool = cls(
            layers=layers,
            token_ids=token_ids,
            config=config,
            fingerprint=model_fingerprint(model, tokenizer),
            prefix_messages=prefix_messages,
            fp16_nbytes=fp16_nbytes,
            model_dtype_nbytes=model_dtype_nbytes,
            composition=None if composition is None else composition.model_dump(mode="json"),
        )
        logger.info("built %r", pool)
        return pool

    # ---------------------------------------------------------------- what it is

    @property
    def layers(self) -> tuple[EncodedLayer, ...]:
        return self._layers

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_tokens(self) -> int:
        return int(self._token_ids.numel())

    @property
    def token_ids(self) -> torch.Tensor:
        """The document's token ids ``[T]`` (a copy: the pool's own stay unchanged)."""
        return self._token_ids.clone()

    @property
    def nbytes(self) -> int:
        """Bytes stored for the KV cache: codes, scales and norms of every layer."""
        return sum(layer.nbytes for layer in self._layers)

    @property
    def compression_ratio(self) -> float:
        """``fp16_nbytes / nbytes``, both measured."""
        return self.fp16_nbytes / self.nbytes

    def memory_report(self, n_agents: int) -> MemoryReport:
        """Pool bytes against ``n_agents`` separate uncompressed caches of the same document."""
        return MemoryReport.for_pool(self, n_agents)

    def _compute_digest(self) -> str:
        return pool_digest(
            self.fingerprint,
            self.config,
            self._token_ids,
            chat_prefix=self.prefix_messages is not None,
            composition=self.composition,
        )

    def tensor_checksum(self) -> str:
        """SHA-256 over every stored tensor's bytes (proves the pool was never written)."""
        h = hashlib.sha256()
        for layer in self._layers:
            for encoded in (layer.keys, layer.values):
                for name in sorted(encoded.tensors):
                    h.update(encoded.tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # ---------------------------------------------------------------- reading

    def check_compatible(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raise ``ValueError`` unless ``model``/``tokenizer`` are the ones this pool was built with."""
        check_same_model(self.fingerprint, model, tokenizer)

    def decompress_layer(
        self, layer_idx: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded ``(keys, values)`` of one layer, each ``[1, kv_heads, T, head_dim]``."""
        layer = self._layers[layer_idx]
        keys, values = decode(layer.keys, dtype), decode(layer.values, dtype)
        if device is not None:
            keys, values = keys.to(device), values.to(device)
        return keys, values

    def to_cache(self, model: PreTrainedModel):
        """A fresh transformers ``DynamicCache`` holding the decoded pool, in the model's dtype and
        device. The cache is the caller's own: writing to it never touches the pool."""
        layers = [
            run_on_compute_thread(self.decompress_layer, i, dtype=model.dtype, device=model.device)
            for i in range(self.num_layers)
        ]
        return cache_from_key_values(model, layers)
