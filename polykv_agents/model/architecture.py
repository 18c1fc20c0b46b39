"""Which models a pool can be built for, and how long their documents may be.

A pool stores, per decoder layer, the keys and values ``[1, kv_heads, T, head_dim]`` of every
document token. That fits decoder-only transformers whose cache layers hold exactly that: full
attention layers, and sliding-window layers as long as the document fits in the window. It does not
fit recurrent or hybrid state (Mamba, linear attention), encoder-decoder models, or caches that
keep a selection of tokens. Those are refused here, before any prefill, with a message that says so.

Sliding-window layers (Mistral, Gemma 2's alternating local layers) keep only the last
``window - 1`` tokens, while a pool stores the same ``T`` document tokens for every layer. A
document longer than that is therefore refused before the prefill (a current limit of the pool
layout, not of the method: those layers only ever attend to the last ``window - 1`` tokens, so a
per-layer token count would lift it). Within the window, an agent's own turns may run past it;
attention then drops the oldest tokens as the model itself does.
"""

from __future__ import annotations

from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

_ATTENTION_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def check_causal_lm(model: object) -> None:
    """Raise a clear ``TypeError`` unless ``model`` is a decoder-only Hugging Face model that can generate
    and whose cache is plain attention keys and values (see the module docstring)."""
    can_generate = getattr(model, "can_generate", None)
    if not isinstance(model, PreTrainedModel) or not callable(can_generate) or not can_generate():
        msg = (
            f"{type(model).__name__} is not a causal language model. Load one with "
            "polykv_agents.load_model(...) or transformers.AutoModelForCausalLM."
        )
        raise TypeError(msg)
    if getattr(model.config, "is_encoder_decoder", False):
        msg = (
            f"{type(model).__name__} is an encoder-decoder model; a SharedKVPool holds a decoder-only model's "
            "attention cache. Use a decoder-only causal LM (Llama, Qwen2, Mistral, Phi-3, Gemma 2, GPT-2, ...)."
        )
        raise TypeError(msg)
    unsupported = sorted(
        {type(layer).__name__ for layer in _cache_layers(model) if type(layer) not in _ATTENTION_LAYERS}
    )
    if unsupported:
        msg = (
            f"{type(model).__name__} keeps {', '.join(unsupported)} cache layers (recurrent, hybrid or "
            "token-selecting state), which a SharedKVPool cannot hold: it stores attention keys and values of "
            "every document token. Use a decoder-only transformer with full or sliding-window attention."
        )
        raise TypeError(msg)


def document_token_limit(model: PreTrainedModel) -> int | None:
    """Most tokens the narrowest sliding-window layer attends to (``window - 1``), or ``None`` when every layer
    attends to all tokens. Pools are not bound by it (they keep every token, and masks apply each window); keys
    moved and recomputed in place are (:mod:`polykv_agents.pool.recompute` builds its own mask, without windows)."""
    windows = [layer.sliding_window for layer in _cache_layers(model) if isinstance(layer, DynamicSlidingWindowLayer)]
    return min(windows) - 1 if windows else None


def _cache_layers(model: PreTrainedModel) -> list:
    # The layers transformers itself would cache for this model, built from its config (no tensors yet).
    return list(getattr(DynamicCache(config=model.config), "layers", []))


def unsupported_batched_attention(model: PreTrainedModel) -> str | None:
    """Why the batched runtime's cascade attention cannot serve ``model`` (``None`` when it can).

    Cascade attention implements plain softmax attention with causal masks, sliding windows and logit
    soft-capping. A model known to need more is named here before any call; anything that still slips
    through is refused inside the attention call itself (``check_attention_kwargs``), never ignored.
    """
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        return f"{name} uses ALiBi position biases, which cascade attention does not add"
    if getattr(config, "attention_chunk_size", None):
        return f"{name} uses chunked local attention, which cascade attention does not mask"
    if getattr(config, "use_bidirectional_attention", False):
        return f"{name} uses bidirectional attention, which cascade attention does not implement"
    if any(getattr(module, "sinks", None) is not None for module in model.modules()):
        return f"{name} uses attention sinks, which cascade attention does not implement"
    return None
