"""Moving cached keys to other positions: rotary position embeddings (RoPE) compose, ``R(p + d) = R(d) R(p)``.

A key cached at position ``p`` is ``R(p) k``. Rotating it by ``R(d)`` gives exactly the key the same token's
``k`` would have at ``p + d``; values carry no position at all. So keys and values computed in one context can be
read at other positions (a second document after a first) without running the model again. What moving cannot
change is what the tokens attended to when they were computed: that is the approximation, and what recomputing
some of them repairs (:mod:`polykv_agents.pool.compose`).

Only rotations whose frequencies do not depend on the sequence length compose this way. Models with absolute
position embeddings (GPT-2) or length-dependent RoPE variants (dynamic NTK, LongRoPE) are refused with the
reason.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import PreTrainedModel

from polykv_agents.codecs.rotary import rotate_half_apply

_ROTARY: weakref.WeakKeyDictionary[PreTrainedModel, torch.nn.Module] = weakref.WeakKeyDictionary()
"""Each model's rotary module, found once: keys are moved per layer and per block."""

MOVABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""RoPE variants whose per-position rotation is fixed, so that rotations by ``p`` and ``d`` compose to ``p + d``."""


def rotary_embedding(model: PreTrainedModel) -> torch.nn.Module:
    """The model's rotary embedding module (``cos, sin = module(x, position_ids)``).

    Raises:
        ValueError: The model has no rotary embedding, or one whose rotations do not compose.
    """
    if model in _ROTARY:
        return _ROTARY[model]
    modules = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not modules:
        msg = (
            f"{type(model).__name__} has no rotary position embedding, so cached keys cannot be moved to other "
            "positions (its positions are added to the hidden states); prefill the documents as one instead"
        )
        raise ValueError(msg)
    module = modules[0]
    if "layer_type" in inspect.signature(module.forward).parameters:
        msg = (
            f"{type(model).__name__} rotates keys differently by layer type (local and global RoPE bases), which "
            "moving cached keys does not implement yet; prefill the documents as one instead"
        )
        raise ValueError(msg)
    rope_type = getattr(module, "rope_type", "default")
    if rope_type not in MOVABLE_ROPE_TYPES:
        msg = (
            f"{type(model).__name__} uses RoPE type {rope_type!r}, whose rotation depends on the sequence length, "
            f"so keys moved to other positions would be wrong; movable types: {sorted(MOVABLE_ROPE_TYPES)}"
        )
        raise ValueError(msg)
    _ROTARY[model] = module
    return module


@torch.inference_mode()
def move_keys(model: PreTrainedModel, keys: torch.Tensor, shift: int) -> torch.Tensor:
    """``keys [B, kv_heads, n, head_dim]`` cached at positions ``p``, as they would be at ``p + shift``.

    The rotated part is the first ``rotary_dim`` channels of each head (all of them but for partial RoPE, as in
    Phi-3's ``partial_rotary_factor``), in the ``rotate_half`` layout transformers uses for every model it ships.
    """
    module = rotary_embedding(model)
    position = torch.full((1, 1), shift, device=keys.device)
    cos, sin = module(keys.float(), position)  # [1, 1, rotary_dim], scaled by attention_scaling (YaRN)
    scaling = float(getattr(module, "attention_scaling", 1.0))
    cos, sin = cos[0] / scaling, sin[0] / scaling  # [1, rotary_dim]: R(shift), no extra scaling
    rotary_dim = cos.shape[-1]
    moved = rotate_half_apply(keys[..., :rotary_dim].float(), cos, sin)
    return torch.cat([moved.to(keys.dtype), keys[..., rotary_dim:]], dim=-1)


def rope_frequencies(model: PreTrainedModel, layer_idx: int) -> torch.Tensor:
    """The rotary frequencies ``inv_freq [rotary_dim / 2]`` (float32, CPU) that rotated layer ``layer_idx``'s keys.

    Models that rotate by layer type (Gemma 3: local and global RoPE bases) give the frequencies of that
    layer's type. A model without rotary embeddings (GPT-2: positions added to the hidden states) rotates no
    channel: its frequencies are empty, and its cached keys are already as they are before RoPE.

    Raises:
        ValueError: The model's rotation depends on the sequence length (dynamic NTK, LongRoPE).
    """
    modules = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not modules:
        return torch.empty(0)
    module = modules[0]
    rope_type = getattr(module, "rope_type", "default")
    inv_freq = getattr(module, "inv_freq", None)
    if inv_freq is None:  # one rotation per layer type
        layer_type = model.config.get_text_config().layer_types[layer_idx]
        inv_freq = getattr(module, f"{layer_type}_inv_freq")
        rope_type = rope_type[layer_type]
    if rope_type not in MOVABLE_ROPE_TYPES:
        msg = (
            f"{type(model).__name__} uses RoPE type {rope_type!r}, whose rotation depends on the sequence length, "
            f"so keys cannot be compressed before RoPE; use a key codec with before_rope=False "
            f"(supported types: {sorted(MOVABLE_ROPE_TYPES)})"
        )
        raise ValueError(msg)
    return inv_freq.detach().float().cpu().clone()
