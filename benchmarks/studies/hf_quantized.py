"""transformers' own quantized KV cache (``QuantizedCache``, KIVI-style) as a compression peer of the pool.

A user who wants a smaller KV cache without this package would reach for ``QuantizedCache``, so it
is measured by the quality suite's protocol (:mod:`polykv_agents.eval.perplexity`): tokens ``[0, C)``
are the prefix, ``[C, C+M)`` the continuation, and the continuation's ``M - 1`` tokens are scored in
one forward over the cache.

- **full precision**: the project's own chunked prefill into a ``DynamicCache``, scored as
  :func:`~polykv_agents.eval.perplexity.perplexity_deltas` scores it, so ``ppl_full`` is the same number;
- **quantized**: the prefix is prefilled into a fresh ``QuantizedCache`` in *one* forward. Its layers
  quantize everything they receive on their first update and keep an empty full-precision residual,
  so the whole prefix is stored quantized (checked, not assumed) while the prefill itself attends in
  full precision, as the pool's prefill does. Chunking would not be the same thing: every later chunk
  would attend to the dequantized earlier ones and re-quantize them, compounding the error.

``kv_bytes`` is the ``nbytes`` of the tensors the cache holds after the prefill (packed codes, scales,
shifts, and the residual), found by walking quanto's tensor subclasses; ``fp16_kv_bytes`` is the
full-precision prefix cache cast to fp16, as :class:`~polykv_agents.pool.shared_pool.SharedKVPool`
counts its ``fp16_nbytes``.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.eval.perplexity import continuation_nll, prefix_and_continuation
from polykv_agents.model.compat import forward_with_cache, layer_key_values
from polykv_agents.pool.prefill import DEFAULT_CHUNK_SIZE, prefill_cache

BACKEND_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq"}
"""The group-wise ``QuantizedCache`` backends measured here, and the module each needs."""

PEERS_INSTALL = 'pip install "polykv-agents[peers]"'


def _require_backend(backend: str) -> None:
    if backend not in BACKEND_MODULES:
        msg = f"backend must be one of {sorted(BACKEND_MODULES)}, got {backend!r}"
        raise ValueError(msg)
    module = BACKEND_MODULES[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is missing
        found = False
    if not found:
        msg = f"QuantizedCache(backend={backend!r}) needs the {module!r} package; install it with: {PEERS_INSTALL}"
        raise ImportError(msg)


def _storage_nbytes(obj: Any) -> int:
    """``nbytes`` of the plain tensors inside ``obj``: a quanto ``QTensor`` is opened through
    ``__tensor_flatten__`` (``_data``, ``_scale``, ``_shift``, and a packed ``_data`` inside), recursively;
    tuples, lists and dicts (hqq keeps ``(codes, meta)``) are walked."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(_storage_nbytes(getattr(obj, name)) for name in names)
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_storage_nbytes(item) for item in obj)
    if isinstance(obj, dict):
        return sum(_storage_nbytes(item) for item in obj.values())
    return 0


def quantized_cache_nbytes(cache) -> int:
    """Bytes a ``QuantizedCache`` holds: its layers' quantized keys and values (codes, scales, shifts)
    plus the full-precision residual keys and values, from the tensors that exist."""
    total = 0
    for layer in cache.layers:
        total += _storage_nbytes(layer._quantized_keys) + _storage_nbytes(layer._quantized_values)
        total += _storage_nbytes(layer.keys) + _storage_nbytes(layer.values)
    return total


@torch.inference_mode()
def prefill_quantized_cache(
    model: PreTrainedModel,
    prefix: torch.Tensor,
    *,
    nbits: int,
    backend: str = "quanto",
    q_group_size: int = 64,
    residual_length: int = 128,
):
    """A fresh ``QuantizedCache`` holding ``prefix [T]``, prefilled in one forward and quantized whole.

    Raises:
        ImportError: The backend's package is not installed.
        RuntimeError: A layer did not end up with all ``T`` tokens quantized and an empty residual.
    """
    _require_backend(backend)
    from transformers import QuantizedCache

    cache = QuantizedCache(
        backend=backend, config=model.config, nbits=nbits, q_group_size=q_group_size, residual_length=residual_length
    )
    forward_with_cache(model, prefix.to(model.device).unsqueeze(0), cache, start_position=0, logits_to_keep=1)
    num_tokens = prefix.numel()
    for index, layer in enumerate(cache.layers):
        quantized = layer._quantized_keys
        quantized_tokens = quantized.shape[-2] if isinstance(quantized, torch.Tensor) else None
        if (
            layer.cumulative_length != num_tokens
            or layer.keys.numel() != 0
            or quantized_tokens not in (None, num_tokens)
        ):
            msg = (
                f"layer {index} of the QuantizedCache holds {layer.cumulative_length} tokens, {quantized_tokens} "
                f"of them quantized and a residual of shape {tuple(layer.keys.shape)}; expected all {num_tokens} "
                "prefix tokens quantized and an empty residual"
            )
            raise RuntimeError(msg)
    return cache


def quantized_cache_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    context_tokens: int,
    continuation_tokens: int,
    nbits: int,
    backend: str = "quanto",
    q_group_size: int = 64,
    residual_length: int = 128,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> dict[str, Any]:
    """Continuation perplexity over the full-precision prefix cache and over a ``QuantizedCache`` of it.

    Returns:
        ``{"backend", "nbits", "context_tokens", "kv_bytes", "ppl_full", "ppl_quantized", "delta_pct",
        "fp16_kv_bytes"}``; ``delta_pct = 100 * (ppl_quantized - ppl_full) / ppl_full``.

    Raises:
        ImportError: The backend's package is not installed.
        ValueError: The text is too short, or the lengths are out of range for the model.
    """
    _require_backend(backend)
    prefix, continuation = prefix_and_continuation(model, tokenizer, text, context_tokens, continuation_tokens)

    cache, _ = prefill_cache(model, prefix, chunk_size=chunk_size)
    # As SharedKVPool.from_cache counts fp16_nbytes.
    fp16_kv_bytes = sum(k.to(torch.float16).nbytes + v.to(torch.float16).nbytes for k, v in layer_key_values(cache))
    nll_full = continuation_nll(model, cache, continuation, context_tokens)
    del cache

    quantized = prefill_quantized_cache(
        model, prefix, nbits=nbits, backend=backend, q_group_size=q_group_size, residual_length=residual_length
    )
    kv_bytes = quantized_cache_nbytes(quantized)  # before the continuation is appended to it
    nll_quantized = continuation_nll(model, quantized, continuation, context_tokens)

    ppl_full, ppl_quantized = math.exp(nll_full), math.exp(nll_quantized)
    return {
        "backend": backend,
        "nbits": nbits,
        "context_tokens": context_tokens,
        "kv_bytes": kv_bytes,
        "ppl_full": ppl_full,
        "ppl_quantized": ppl_quantized,
        "delta_pct": 100.0 * (ppl_quantized - ppl_full) / ppl_full,
        "fp16_kv_bytes": fp16_kv_bytes,
    }
