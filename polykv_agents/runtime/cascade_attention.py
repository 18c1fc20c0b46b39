"""Cascade (Hydragen-style) attention: every agent's queries against ONE shared prefix, plus each
agent's own suffix, merged exactly by log-sum-exp.

Registered with transformers' ``AttentionInterface`` as ``polykv_cascade``: a model switched to it
runs plain SDPA for ordinary calls, and cascade attention for calls that pass a
:class:`CascadeContext` (the batched runtime does).

Shapes (B agents in the batch, q new tokens each, H query heads, KVH kv heads, G = H / KVH):
  query  [B, H, q, D]
  prefix [1, KVH, T, D]  (shared: read once per layer for the whole batch)
  suffix [B, KVH, S, D]  (each agent's own tokens, padded to the longest; row r's slots
                          ``starts[r] .. lengths[r] + q - 1`` are valid after this step's update)

  prefix part: q -> [KVH, B*G*q, D] @ [KVH, D, T] -> softmax with log-sum-exp l1 -> o1
  suffix part: per-agent masked attention -> l2, o2
  out = (o1 * exp(l1 - m) + o2 * exp(l2 - m)) / (exp(l1 - m) + exp(l2 - m)),  m = max(l1, l2)
which equals softmax attention over the concatenation [prefix, suffix] without ever building it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from polykv_agents.runtime.shared_prefix import SharedPrefix

ATTENTION_NAME = "polykv_cascade"


class CascadeContext:
    """What one batched forward needs beyond the model's own arguments.

    Args:
        prefix: The shared prefix every row attends to.
        past_lengths: ``[B]`` suffix slots each row had filled before this step.
        starts: ``[B]`` leading slots of each row that hold left padding (never attended to);
            ``None`` for none.
    """

    def __init__(self, prefix: SharedPrefix, past_lengths: torch.Tensor, starts: torch.Tensor | None = None) -> None:
        self.prefix = prefix
        self.past_lengths = past_lengths
        self.starts = torch.zeros_like(past_lengths) if starts is None else starts
        self._mask: torch.Tensor | None = None

    def suffix_mask(self, suffix_len: int, q_len: int, device: torch.device) -> torch.Tensor:
        """``[B, 1, 1, q, S]``: row r's query i sees suffix slot j iff ``starts[r] <= j <= past[r] + i``.

        Built once per forward and shared by every layer.
        """
        if self._mask is None or self._mask.shape[-1] != suffix_len or self._mask.shape[-2] != q_len:
            batch = self.past_lengths.numel()
            slots = torch.arange(suffix_len, device=device).view(1, 1, suffix_len)
            limits = self.past_lengths.to(device).view(batch, 1) + torch.arange(q_len, device=device)
            visible = (slots <= limits.view(batch, q_len, 1)) & (slots >= self.starts.to(device).view(batch, 1, 1))
            self._mask = visible.view(batch, 1, 1, q_len, suffix_len)
        return self._mask


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask=None):
    """Softmax attention that also returns the log-sum-exp of the scores.

    query [..., n, D], keys/values [..., k, D], mask broadcastable to [..., n, k] (True = attend).
    Returns ``(out [..., n, D], lse [..., n, 1])``, both float32.
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # One exp pass serves both the output and the log-sum-exp (torch.logsumexp would add a second).
    top = scores.amax(dim=-1, keepdim=True)
    # A fully masked row (a left-padding query) must give out = 0 and lse = -inf, not NaN: NaN here
    # would flow into the padding slots' keys/values, and 0 * NaN poisons every later weighted sum.
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, values.float()) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return out, top + torch.log(total)


def cascade_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cascade: CascadeContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: SDPA unless a :class:`CascadeContext` is passed."""
    if cascade is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("softcap") is not None or getattr(module, "sliding_window", None):
        msg = "cascade attention does not support logit soft-capping or sliding-window layers yet"
        raise NotImplementedError(msg)
    batch, heads, q_len, head_dim = query.shape
    scaling = scaling if scaling is not None else head_dim**-0.5
    prefix_keys, prefix_values = cascade.prefix.layer(module.layer_idx)  # [1, KVH, T, D]
    kv_heads = prefix_keys.shape[1]
    groups = heads // kv_heads

    # Prefix: all rows' queries in one batched matmul per kv head: [KVH, B*G*q, D].
    grouped = query.view(batch, kv_heads, groups, q_len, head_dim).permute(1, 0, 2, 3, 4)
    grouped = grouped.reshape(kv_heads, batch * groups * q_len, head_dim)
    out_prefix, lse_prefix = _attend(grouped, prefix_keys[0], prefix_values[0], scaling)
    out_prefix = out_prefix.view(kv_heads, batch, groups, q_len, head_dim).permute(1, 0, 2, 3, 4)
    lse_prefix = lse_prefix.view(kv_heads, batch, groups, q_len, 1).permute(1, 0, 2, 3, 4)

    # Suffix: each row's own tokens, causal, left padding masked.
    mask = cascade.suffix_mask(key.shape[-2], q_len, query.device)
    grouped_query = query.view(batch, kv_heads, groups, q_len, head_dim)
    out_suffix, lse_suffix = _attend(grouped_query, key.unsqueeze(2), value.unsqueeze(2), scaling, mask)

    # Exact merge of the two softmax parts.  [B, KVH, G, q, D]
    top = torch.maximum(lse_prefix, lse_suffix)
    w_prefix, w_suffix = torch.exp(lse_prefix - top), torch.exp(lse_suffix - top)
    out = (out_prefix * w_prefix + out_suffix * w_suffix) / (w_prefix + w_suffix)
    out = out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()  # [B, q, H, D]
    return out.to(query.dtype), None


def register_cascade_attention() -> str:
    """Register the attention function (idempotent) and return its name."""
    AttentionInterface.register(ATTENTION_NAME, cascade_attention_forward)
    # Ordinary calls need SDPA's masks; cascade calls build their own and ignore the one passed.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def enable_cascade_attention(model) -> None:
    """Switch ``model`` to cascade attention. Ordinary calls keep SDPA's numerics exactly."""
    name = register_cascade_attention()
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
