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

  prefix part: q -> [1, KVH, B*G*q, D] against [1, KVH, T, D] -> softmax with log-sum-exp l1 -> o1
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
        self._masks: dict[tuple, torch.Tensor] = {}

    def suffix_mask(self, suffix_len: int, q_len: int, groups: int, device: torch.device) -> torch.Tensor:
        """``[B, 1, G*q, S]`` bool: row r's query i (each of its G heads per kv head) sees suffix slot j
        iff ``starts[r] <= j <= past[r] + i``. Built once per forward and shared by every layer."""
        key = (suffix_len, q_len, groups, device)
        if key not in self._masks:
            batch = self.past_lengths.numel()
            slots = torch.arange(suffix_len, device=device).view(1, 1, suffix_len)
            limits = self.past_lengths.to(device).view(batch, 1) + torch.arange(q_len, device=device)
            visible = (slots <= limits.view(batch, q_len, 1)) & (slots >= self.starts.to(device).view(batch, 1, 1))
            grouped = visible.view(batch, 1, 1, q_len, suffix_len).expand(batch, 1, groups, q_len, suffix_len)
            self._masks[key] = grouped.reshape(batch, 1, groups * q_len, suffix_len)
        return self._masks[key]

    def additive_suffix_mask(self, suffix_len: int, q_len: int, groups: int, dtype: torch.dtype, device):
        """:meth:`suffix_mask` as the fused kernel wants it: 0 where visible, -inf elsewhere, in the
        query's dtype. Built once per forward."""
        key = (suffix_len, q_len, groups, device, dtype)
        if key not in self._masks:
            visible = self.suffix_mask(suffix_len, q_len, groups, device)
            self._masks[key] = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, -torch.inf)
        return self._masks[key]


def _attend_unfused(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask=None):
    """Softmax attention that also returns the log-sum-exp of the scores, on any device.

    query [N, H, n, D], keys/values [N, H, k, D], mask bool broadcastable to [N, H, n, k] (True =
    attend). Returns ``(out [N, H, n, D], lse [N, H, n])``, both float32.
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # One exp pass serves both the output and the log-sum-exp (torch.logsumexp would add a second).
    top = scores.amax(dim=-1, keepdim=True)
    # A fully masked row (a left-padding query) must give a finite output, not NaN: NaN here would
    # flow into the padding slots' keys/values, and 0 * NaN poisons every later weighted sum.
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, values.float()) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return out, (top + torch.log(total)).squeeze(-1)


# PyTorch's fused CPU attention kernel (what F.scaled_dot_product_attention runs on CPU), called
# directly because it also returns the log-sum-exp the merge needs. It never materialises the
# [n, k] score matrix: measured here 3x faster than _attend_unfused for one decode step over a 2K
# prefix, 4x for an admission prefill. Fully masked rows give out 0 and a finite lse.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _attend(query, keys, values, scaling: float, *, bool_mask=None, additive_mask=None):
    """``(out [N, H, n, D] float32, lse [N, H, n] float32)``: the fused kernel on CPU, else unfused.

    Pass the mask both ways (``additive_mask`` for the fused kernel, ``bool_mask`` for the fallback)
    so that neither path converts per layer.
    """
    if _CPU_FLASH is not None and query.device.type == "cpu" and query.dtype in _FLASH_DTYPES:
        out, lse = _CPU_FLASH(query, keys, values, 0.0, False, attn_mask=additive_mask, scale=scaling)[:2]
        return out.float(), lse.float()
    return _attend_unfused(query, keys, values, scaling, bool_mask)


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

    # Prefix: all rows' queries against the one prefix, per kv head: [1, KVH, B*G*q, D].
    grouped = query.reshape(batch, kv_heads, groups * q_len, head_dim).transpose(0, 1)
    grouped = grouped.reshape(1, kv_heads, batch * groups * q_len, head_dim)
    out_prefix, lse_prefix = _attend(grouped, prefix_keys, prefix_values, scaling)
    out_prefix = out_prefix.view(kv_heads, batch, groups * q_len, head_dim).transpose(0, 1)
    lse_prefix = lse_prefix.view(kv_heads, batch, groups * q_len).transpose(0, 1)

    # Suffix: each row's own tokens, causal, left padding masked.  [B, KVH, G*q, D]
    suffix_len = key.shape[-2]
    out_suffix, lse_suffix = _attend(
        query.reshape(batch, kv_heads, groups * q_len, head_dim),
        key,
        value,
        scaling,
        bool_mask=cascade.suffix_mask(suffix_len, q_len, groups, query.device),
        additive_mask=cascade.additive_suffix_mask(suffix_len, q_len, groups, query.dtype, query.device),
    )

    # Exact merge of the two softmax parts.  [B, KVH, G*q, D]
    top = torch.maximum(lse_prefix, lse_suffix)
    w_prefix = torch.exp(lse_prefix - top).unsqueeze(-1)
    w_suffix = torch.exp(lse_suffix - top).unsqueeze(-1)
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
