"""Cascade (Hydragen-style) attention: every agent's queries against ONE shared prefix, plus each
agent's own suffix, merged exactly by log-sum-exp.

Registered with transformers' ``AttentionInterface`` as ``polykv_cascade`` (over ``sdpa``) or
``polykv_cascade_<base>``: a model switched to it runs its original attention for ordinary calls,
and cascade attention for calls that pass a :class:`CascadeContext` (the batched runtime does).

Shapes (B agents in the batch, q new tokens each, H query heads, KVH kv heads, G = H / KVH):
  query  [B, H, q, D]
  prefix [1, KVH, T, D]  (shared: read once per layer for the whole batch)
  suffix [B, KVH, S, D]  (each agent's own tokens, padded to the longest; row r's slots
                          ``starts[r] .. lengths[r] + q - 1`` are valid after this step's update)

  prefix part: q -> [1, KVH, B*G*q, D] against [1, KVH, T, D] -> softmax with log-sum-exp l1 -> o1
  suffix part: per-agent masked attention -> l2, o2
  out = (o1 * exp(l1 - m) + o2 * exp(l2 - m)) / (exp(l1 - m) + exp(l2 - m)),  m = max(l1, l2)
which equals softmax attention over the concatenation [prefix, suffix] without ever building it.

Model-specific attention features follow the model's own attention function:
- sliding-window layers (``sliding_window`` kwarg: Mistral, Gemma 2's local layers) mask prefix and
  suffix keys more than ``window - 1`` positions behind each query, as transformers' masks do;
  a part with no visible key gets weight 0 in the merge;
- logit soft-capping (``softcap`` kwarg: Gemma 2) caps the scores before the softmax, as the
  model's eager attention does (the fused CPU kernel cannot, so those layers run unfused).
Any other attention keyword with a value (attention sinks, ALiBi slopes, ...) is refused with
:class:`UnsupportedAttentionError` rather than ignored: the batched runtime is never served wrongly
(:data:`SUPPORTED_ATTENTION_KWARGS` is the allow-list; models known to need more are sent to the
private runtime before any call, see :func:`polykv_agents.model.architecture.unsupported_batched_attention`).
Ordinary calls (no :class:`CascadeContext`) run the attention the model had before it was switched
(``sdpa``, ``eager``, ...), so switching never changes a model's plain ``generate``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch._prims_common import make_contiguous_strides_for
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from polykv_agents.runtime.grouped_attention import KernelGroup, grouped_attention, kernel_takes
from polykv_agents.runtime.packed_step import PackedCascade
from polykv_agents.runtime.shared_prefix import SharedPrefix

SUPPORTED_ATTENTION_KWARGS = frozenset({"sliding_window", "softcap"})
"""Attention features cascade attention implements (each as the model's own attention does)."""

IGNORED_ATTENTION_KWARGS = frozenset(
    {"position_ids", "cache_position", "use_cache", "output_attentions", "output_router_logits", "is_causal"}
)
"""Keywords models pass along that do not change attention over an explicit cascade context: positions
are already in the rotated queries and keys, causality is the cascade masks' job, and the rest are
output switches."""


class UnsupportedAttentionError(NotImplementedError):
    """A model passed an attention feature that cascade attention does not implement."""


def check_attention_kwargs(kwargs: dict) -> None:
    """Raise :class:`UnsupportedAttentionError` if ``kwargs`` carries a feature outside the allow-list."""
    unknown = sorted(
        name
        for name, value in kwargs.items()
        if value is not None and name not in SUPPORTED_ATTENTION_KWARGS and name not in IGNORED_ATTENTION_KWARGS
    )
    if unknown:
        msg = (
            f"the batched runtime's cascade attention does not implement the attention feature(s) {unknown} this "
            "model uses; use runtime='private' for it (ChatPolyKV(runtime='private') or PooledAgent(..., "
            "runtime='private'))"
        )
        raise UnsupportedAttentionError(msg)


ATTENTION_NAME = "polykv_cascade"
"""Name of the cascade attention over an ``sdpa`` model; over another base it is ``polykv_cascade_<base>``."""


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

    def kernel_group(
        self, query: torch.Tensor, layer_idx: int, suffix: tuple[torch.Tensor, torch.Tensor]
    ) -> KernelGroup:
        """This context's rows as a group of the native kernel: ``query [B, H, q, D]``, the prefix of layer
        ``layer_idx`` (as the pool stores it, where the prefix has that form) and the ``suffix`` keys and values."""
        batch, heads, q_len, head_dim = query.shape
        starts = self._cached(("kernel starts",), lambda: self.starts.to(torch.int64).contiguous())
        past = self._cached(("kernel past",), lambda: self.past_lengths.to(torch.int64).contiguous())
        flat = query.transpose(0, 1).reshape(heads, batch * q_len, head_dim)  # [H, B*q, D], (row, token) order
        stored = self.prefix.stored(layer_idx)
        if stored is not None:
            return KernelGroup(flat, None, None, *suffix, starts, past, q_len, stored)
        prefix = tuple(t.to(query.dtype) for t in self.prefix.layer(layer_idx))  # a no-op: kept in the model's dtype
        return KernelGroup(flat, *prefix, *suffix, starts, past, q_len)

    def kernel_takes(self, query: torch.Tensor, keys: torch.Tensor, layer_idx: int, kwargs: dict) -> bool:
        """Whether this context's rows (``query [B, H, q, D]``, suffix ``keys [B, KVH, S, D]``) go to the native
        kernel in layer ``layer_idx`` (:func:`~polykv_agents.runtime.grouped_attention.kernel_takes`)."""
        batch, heads, q_len, _ = query.shape
        queries_per_kv_head = batch * q_len * (heads // keys.shape[1])
        stored = self.prefix.stored(layer_idx) is not None
        return kernel_takes(query, keys, queries_per_kv_head, kwargs, stored=stored)

    def _cached(self, key: tuple, build: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        # Every layer of one forward asks for the same masks: build each once per forward.
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def query_positions(self, q_len: int) -> torch.Tensor:
        """``[B, q]`` absolute positions of this step's queries (the prefix holds positions ``0 .. T-1``)."""
        return self.prefix.num_tokens + (self.past_lengths - self.starts).view(-1, 1) + torch.arange(q_len)

    def suffix_mask(
        self, suffix_len: int, q_len: int, groups: int, device: torch.device, window: int | None = None
    ) -> torch.Tensor:
        """``[B, 1, G*q, S]`` bool: row r's query i (each of its G heads per kv head) sees suffix slot j
        iff ``starts[r] <= j <= past[r] + i`` and, in a sliding-window layer, ``j > past[r] + i - window``."""

        def build() -> torch.Tensor:
            batch = self.past_lengths.numel()
            slots = torch.arange(suffix_len, device=device).view(1, 1, suffix_len)
            limits = (self.past_lengths.to(device).view(batch, 1) + torch.arange(q_len, device=device)).unsqueeze(-1)
            visible = (slots <= limits) & (slots >= self.starts.to(device).view(batch, 1, 1))
            if window is not None:
                visible &= slots > limits - window
            return _grouped(visible, groups).reshape(batch, 1, groups * q_len, suffix_len)

        return self._cached(("suffix", suffix_len, q_len, groups, device, window), build)

    def prefix_mask(self, q_len: int, groups: int, device: torch.device, window: int | None) -> torch.Tensor | None:
        """``[1, 1, B*G*q, T]`` bool, in the prefix part's row order (row, head in group, query): which
        prefix tokens each query sees in a sliding-window layer; ``None`` when every query sees all of them."""

        def build() -> torch.Tensor | None:
            if window is None or int(self.query_positions(q_len).max()) - window < 0:
                return None  # no query is a whole window past the first prefix token
            return self.prefix_window_mask(q_len, groups, device, window)

        return self._cached(("prefix", q_len, groups, device, window), build)

    def prefix_window_mask(self, q_len: int, groups: int, device: torch.device, window: int) -> torch.Tensor:
        """:meth:`prefix_mask` for a ``window``, built even where every query sees every prefix token."""
        positions = self.query_positions(q_len).to(device)  # [B, q]
        tokens = torch.arange(self.prefix.num_tokens, device=device)
        visible = tokens.view(1, 1, -1) > (positions - window).unsqueeze(-1)  # [B, q, T]
        return _grouped(visible, groups).reshape(1, 1, -1, self.prefix.num_tokens)

    def additive(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as the fused kernel wants it: 0 where visible, -inf elsewhere, in ``dtype``."""
        if mask is None:
            return None

        def build() -> torch.Tensor:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)

        # Keyed by id(): safe because every mask passed here is itself held in self._masks for the
        # whole forward, so its id cannot be reused by another tensor meanwhile.
        return self._cached(("additive", id(mask), dtype), build)


def _grouped(visible: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, q, k]`` -> ``[B, G, q, k]``: the same visibility for each of the G query heads of a kv head."""
    batch, q_len, k_len = visible.shape
    return visible.view(batch, 1, q_len, k_len).expand(batch, groups, q_len, k_len)


def _attend_unfused(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask=None, softcap=None
):
    """Softmax attention that also returns the log-sum-exp of the scores, on any device.

    query [N, H, n, D], keys/values [N, H, k, D], mask bool broadcastable to [N, H, n, k] (True =
    attend), softcap: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2). Returns
    ``(out [N, H, n, D], lse [N, H, n])``, both float32; a fully masked row gets lse ``-inf``.
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    weights, top, total = _softmax_parts(scores, mask, softcap)
    out = torch.matmul(weights, values.float()) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return out, (top + torch.log(total)).squeeze(-1)


def _attend_reduced(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask=None, softcap=None
):
    """:func:`_attend_unfused` written as broadcast products and sums: for compiled decode steps only.

    Inductor turns each product-and-sum into one loop that reads the keys (or values) once, in their own
    dtype, and accumulates in float32, with no float copy of them and no score matrix in bf16. For a few
    queries per kv head that is about twice as fast as the fused CPU kernel (which splits its work for
    long query blocks) and as exact (``benchmarks/probes/decode_attention.py``). Run eagerly it would build
    ``[N, H, n, k, D]``: never call it outside ``torch.compile``.
    """
    scores = (query.unsqueeze(-2).float() * keys.unsqueeze(-3).float()).sum(-1) * scaling  # [N, H, n, k]
    weights, top, total = _softmax_parts(scores, mask, softcap)
    out = (weights.unsqueeze(-1) * values.unsqueeze(-3).float()).sum(-2)  # [N, H, n, D]
    return out / total.clamp_min(torch.finfo(total.dtype).tiny), (top + torch.log(total)).squeeze(-1)


def _attend_reduced_in_halves(query, keys, values, scaling: float, mask=None, softcap=None):
    """:func:`_attend_reduced` over each half of the keys, merged: for the shared prefix in compiled steps.

    Where a float32 sum runs over more than 4,096 elements, Inductor switches to a cascaded summation, and it
    guards on the length to choose: one sum over the whole prefix would make the first document past 4,096
    tokens compile every graph again. Over halves, that happens past 8,192 tokens (SmolLM2's whole context),
    at no cost measurable in ``benchmarks/probes/decode_attention.py`` or ``compiled_step_ms.py``.
    """
    length = keys.shape[-2]
    if length < 2:
        return _attend_reduced(query, keys, values, scaling, mask, softcap)
    half = (length + 1) // 2
    parts = [
        _attend_reduced(query, keys[..., part, :], values[..., part, :], scaling, _keys_of(mask, part), softcap)
        for part in (slice(None, half), slice(half, None))
    ]
    out, top, total = _merge(*parts)
    return out, top + torch.log(total)


def _keys_of(mask: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    """The columns of ``mask [..., n, k]`` for the keys in ``part`` (``None``: every key is visible)."""
    return None if mask is None else mask[..., part]


def _merge(first, second) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact merge of two softmax parts over disjoint keys, each ``(out [..., n, D], lse [..., n])``:
    ``(out, top, total)`` with the merged lse ``top + log(total)``. A part with no visible key (lse ``-inf``)
    gets weight 0; where neither has one, out is 0 and total 0."""
    (out_a, lse_a), (out_b, lse_b) = first, second
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # e.g. a left-padding query sees nothing
    w_a = torch.exp(lse_a - top).unsqueeze(-1)
    w_b = torch.exp(lse_b - top).unsqueeze(-1)
    total = w_a + w_b
    out = (out_a * w_a + out_b * w_b) / total.clamp_min(torch.finfo(torch.float32).tiny)
    return out, top, total.squeeze(-1)


def _softmax_parts(scores: torch.Tensor, mask, softcap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(exp(scores - top), top, sum)`` of float32 ``scores [..., n, k]`` after soft-capping and masking."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # One exp pass serves both the output and the log-sum-exp (torch.logsumexp would add a second).
    top = scores.amax(dim=-1, keepdim=True)
    # A fully masked row (a left-padding query) must give a finite output, not NaN: NaN here would
    # flow into the padding slots' keys/values, and 0 * NaN poisons every later weighted sum.
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    return weights, top, weights.sum(dim=-1, keepdim=True)


def _computed_once(query: torch.Tensor) -> torch.Tensor:
    """``query`` written to memory before attention reads it, inside ``torch.compile``.

    Inductor would otherwise inline the query's producer (the model's rotary embedding: a cos and a sin per
    element) into the reduction over the keys, recomputing it for every key: at 4K keys that makes the reduced
    attention slower than the fused kernel, where it should be about twice as fast."""
    # Row-major strides of its shape: the query's own may point past its data (GPT-2's).
    return torch.ops.prims.inductor_force_stride_order(query, make_contiguous_strides_for(query.shape))


REDUCED_MAX_QUERIES = 6
"""Queries per kv head (agents x query heads per kv head) up to which a compiled decode step reads the
shared prefix with :func:`_attend_reduced`; above it the fused kernel is faster (it re-reads less)."""


# PyTorch's fused CPU attention kernel (what F.scaled_dot_product_attention runs on CPU), called
# directly because it also returns the log-sum-exp the merge needs. It never materialises the
# [n, k] score matrix: faster than _attend_unfused, most of all for an admission prefill (`polykv-agents
# bench speed` measures both; docs/RUNTIME.md shows the figures). Fully masked rows give out 0 and a finite lse.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _attend(query, keys, values, scaling: float, *, bool_mask=None, additive_mask=None, softcap=None, reduced=False):
    """``(out [N, H, n, D] float32, lse [N, H, n] float32)``: :func:`_attend_reduced` when ``reduced`` (only
    inside a compiled step), else the fused kernel on CPU, else unfused.

    Pass the mask both ways (``additive_mask`` for the fused kernel, ``bool_mask`` for the others)
    so that no path converts per layer. Rows with no visible key get lse ``-inf`` either way.
    """
    if reduced:
        return _attend_reduced(query, keys, values, scaling, bool_mask, softcap)
    fused = _CPU_FLASH is not None and query.device.type == "cpu" and query.dtype in _FLASH_DTYPES
    if not fused or softcap is not None:
        return _attend_unfused(query, keys, values, scaling, bool_mask, softcap)
    out, lse = _CPU_FLASH(query, keys, values, 0.0, False, attn_mask=additive_mask, scale=scaling)[:2]
    out, lse = out.float(), lse.float()
    if bool_mask is not None:  # the kernel gives such rows a finite lse, which would weigh a zero output in
        lse = lse.masked_fill(~bool_mask.any(dim=-1), -torch.inf)
    return out, lse


def cascade_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cascade: CascadeContext | PackedCascade | None = None,
    *,
    base: str = "sdpa",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: the model's ``base`` attention unless a :class:`CascadeContext` (or a
    :class:`~polykv_agents.runtime.packed_step.PackedCascade` of several) is passed."""
    if cascade is None:
        # By keyword: eager functions take (..., attention_mask, scaling, dropout), sdpa (..., dropout, scaling).
        base_attention = _base_attention(base, module)
        return base_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if isinstance(cascade, PackedCascade):
        return _packed_attention(module, query, cascade, scaling, base, kwargs), None
    check_attention_kwargs(kwargs)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    batch, heads, q_len, head_dim = query.shape
    scaling = scaling if scaling is not None else head_dim**-0.5
    if cascade.kernel_takes(query, key, module.layer_idx, kwargs):
        group = cascade.kernel_group(query, module.layer_idx, (key, value))
        return grouped_attention([group], scaling).view(batch, q_len, heads, head_dim), None
    prefix_keys, prefix_values = cascade.prefix.layer(module.layer_idx)  # [1, KVH, T, D]
    kv_heads = prefix_keys.shape[1]
    groups = heads // kv_heads
    # A compiled decode step (one query per row) fuses attention written as reductions; see _attend_reduced.
    compiled_decode = q_len == 1 and torch.compiler.is_compiling()
    if compiled_decode:
        query = _computed_once(query)

    # Prefix: all rows' queries against the one prefix, per kv head: [1, KVH, B*G*q, D].
    grouped = query.reshape(batch, kv_heads, groups * q_len, head_dim).transpose(0, 1)
    grouped = grouped.reshape(1, kv_heads, batch * groups * q_len, head_dim)
    prefix_mask = cascade.prefix_mask(q_len, groups, query.device, window)
    if compiled_decode and batch * groups <= REDUCED_MAX_QUERIES:
        out_prefix, lse_prefix = _attend_reduced_in_halves(
            grouped, prefix_keys, prefix_values, scaling, prefix_mask, softcap
        )
    else:
        out_prefix, lse_prefix = _attend(
            grouped,
            prefix_keys,
            prefix_values,
            scaling,
            bool_mask=prefix_mask,
            additive_mask=cascade.additive(prefix_mask, query.dtype),
            softcap=softcap,
        )
    out_prefix = out_prefix.view(kv_heads, batch, groups * q_len, head_dim).transpose(0, 1)
    lse_prefix = lse_prefix.view(kv_heads, batch, groups * q_len).transpose(0, 1)

    # Suffix: each row's own tokens, causal, left padding masked.  [B, KVH, G*q, D]
    suffix_mask = cascade.suffix_mask(key.shape[-2], q_len, groups, query.device, window)
    out_suffix, lse_suffix = _attend(
        query.reshape(batch, kv_heads, groups * q_len, head_dim),
        key,
        value,
        scaling,
        bool_mask=suffix_mask,
        additive_mask=cascade.additive(suffix_mask, query.dtype),
        softcap=softcap,
        reduced=compiled_decode,  # each row's own G queries: always few per kv head
    )

    out, _, _ = _merge((out_prefix, lse_prefix), (out_suffix, lse_suffix))  # [B, KVH, G*q, D]
    out = out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()  # [B, q, H, D]
    return out.to(query.dtype), None


def _packed_attention(module, query, packed: PackedCascade, scaling, base: str, kwargs) -> torch.Tensor:
    """Cascade attention of each group of a packed forward (``query [1, H, B + A*c, D]``), each over its own
    context and the keys this layer just wrote to its suffix cache; ``[1, B + A*c, H, D]`` in sequence order.

    The groups the native kernel takes (:func:`~polykv_agents.runtime.grouped_attention.kernel_takes`, decided
    per group) go to it in one call; the others run :func:`cascade_attention_forward` one by one."""
    check_attention_kwargs(kwargs)
    written = packed.cache.layers[module.layer_idx].attended
    heads, head_dim = query.shape[1], query.shape[-1]
    scaling = scaling if scaling is not None else head_dim**-0.5
    outputs: list[torch.Tensor | None] = []  # per group [rows*width, H, D]; None: the kernel's
    native: list[KernelGroup] = []
    for q, group, (k, v) in zip(packed.split(query), packed.groups, written, strict=True):
        if group.context.kernel_takes(q, k, module.layer_idx, kwargs):
            native.append(group.context.kernel_group(q, module.layer_idx, (k, v)))
            outputs.append(None)
        else:
            out = cascade_attention_forward(module, q, k, v, None, scaling=scaling, cascade=group.context, base=base,
                                            **kwargs)[0]  # fmt: skip
            outputs.append(out.reshape(-1, heads, head_dim))
    if native:
        from_kernel = iter(grouped_attention(native, scaling).split([g.query.shape[1] for g in native]))
        outputs = [next(from_kernel) if out is None else out for out in outputs]
    return torch.cat(outputs).unsqueeze(0)


def _base_attention(base: str, module: torch.nn.Module) -> Callable:
    """The attention function ``base`` names for ``module``: ``eager`` is each model file's own function
    (it carries the model's soft-capping, sinks, ...), the others are transformers' registered ones."""
    if base == "eager":
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            msg = (
                f"{type(module).__name__} has no eager attention function; "
                "load the model with attn_implementation='sdpa'"
            )
            raise NotImplementedError(msg)
        return eager
    return ALL_ATTENTION_FUNCTIONS[base] if base != "sdpa" else sdpa_attention_forward


def cascade_attention_name(base: str) -> str:
    """The registered name of cascade attention over ``base`` (the model's attention before the switch)."""
    return ATTENTION_NAME if base == "sdpa" else f"{ATTENTION_NAME}_{base}"


def register_cascade_attention(base: str = "sdpa") -> str:
    """Register cascade attention over ``base`` (idempotent) and return its name."""
    name = cascade_attention_name(base)

    def attention(*args, **kwargs):
        return cascade_attention_forward(*args, base=base, **kwargs)

    AttentionInterface.register(name, attention)
    # Ordinary calls need the base's masks; cascade calls build their own and ignore the one passed.
    base_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(base, sdpa_mask)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, base_mask)
    return name


def enable_cascade_attention(model) -> None:
    """Switch ``model`` to cascade attention over the attention it has now, whose numerics ordinary
    calls keep exactly."""
    current = model.config._attn_implementation or "sdpa"
    if current.startswith(ATTENTION_NAME):
        return  # already switched
    model.set_attn_implementation(register_cascade_attention(current))
