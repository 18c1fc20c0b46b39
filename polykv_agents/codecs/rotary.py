"""Rotary position embedding (RoPE) applied to or removed from cached keys, from the frequencies alone.

Data flow: a key at position ``p`` was rotated by the model, per channel pair ``i``, by the angle
``p * inv_freq[i]`` in transformers' ``rotate_half`` layout (channel ``i`` pairs with channel
``i + rotary_dim / 2``; channels past ``rotary_dim`` are not rotated, as in Phi-3's partial RoPE).
:func:`rotate_keys` applies that rotation for positions ``first_position ..`` or, with
``inverse=True``, removes it. Only the frequencies are needed, so a codec can undo its own
un-rotation at decode time without the model.
"""

from __future__ import annotations

import torch


def rotate_half_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., rotary_dim]`` rotated by ``cos, sin`` (broadcastable to ``x``), in the ``rotate_half`` layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rotate_keys(
    keys: torch.Tensor, inv_freq: torch.Tensor, *, first_position: int = 0, inverse: bool = False
) -> torch.Tensor:
    """``keys [B, kv_heads, T, head_dim]`` at positions ``first_position + t``, rotated (float32).

    ``inverse=False`` applies RoPE to keys that have none; ``inverse=True`` removes it from cached keys.
    ``inv_freq [rotary_dim / 2]``: the model's rotary frequencies for the keys' layer.
    """
    rotary_dim = 2 * inv_freq.numel()
    if rotary_dim > keys.shape[-1]:
        msg = f"{inv_freq.numel()} rotary frequencies rotate {rotary_dim} channels, but the keys have {keys.shape[-1]}"
        raise ValueError(msg)
    positions = torch.arange(keys.shape[-2], device=keys.device, dtype=torch.float32) + first_position
    angles = positions[:, None] * inv_freq.to(device=keys.device, dtype=torch.float32)[None]  # [T, rotary_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, rotary_dim]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    x = keys.float()
    rotated = rotate_half_apply(x[..., :rotary_dim], cos, sin)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
