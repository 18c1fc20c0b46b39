"""The naive batched baseline: N agents decoded in one batched forward per step over the document's
decoded prefix copied once per row, into a preallocated (static) cache.

This is HF's prefix-cache recipe batched, in its best honest configuration: the N copies are written
once into a :class:`~transformers.StaticCache` sized for the whole run, and every step writes one
column in place. (A growing ``DynamicCache`` would copy all N x T prefix rows again at every step,
which made this baseline as slow as decoding one agent at a time.) What it cannot avoid is the point
of the comparison: N copies of the prefix in memory, and attention that reads each of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, StaticCache

from polykv_agents.model.compat import cache_keyword, layer_key_values
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.pool.shared_pool import SharedKVPool


@dataclass(frozen=True)
class NaiveRun:
    """One naive batched run: what it decoded, how long it took, and the bytes of its cache."""

    token_ids: torch.Tensor
    """``[N, max_new_tokens]`` greedy tokens of each row."""
    seconds: float
    """Wall time: copying the prefix, the prompts' prefill and every decode step."""
    kv_bytes: int
    """``nbytes`` of the static cache (allocated for prefix + longest prompt + new tokens, per row)."""


def _left_padded(prompts: list[torch.Tensor], start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [N, W], mask [N, start + W], positions [N, W])`` of prompts left-padded to the longest, ``W``,
    after ``start`` prefix tokens: every row's prompt sits at positions ``start ..`` as in the runtime."""
    rows, width = len(prompts), max(p.numel() for p in prompts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, start + width, dtype=torch.long)
    mask[:, :start] = 1
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt
        mask[row, start + width - prompt.numel() :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:]
    return ids, mask, positions


def naive_batched_decode(
    model: PreTrainedModel, pool: SharedKVPool, prompts: list[torch.Tensor], max_new_tokens: int
) -> NaiveRun:
    """Greedy-decode ``max_new_tokens`` per prompt (EOS ignored) over N copies of the pool's decoded prefix,
    on the compute thread, as the runtime's own steps run.

    ``prompts``: each agent's prompt ids ``[n_i]`` (what comes after the document)."""
    return run_on_compute_thread(_naive_batched_decode, model, pool, prompts, max_new_tokens)


@torch.inference_mode()
def _naive_batched_decode(
    model: PreTrainedModel, pool: SharedKVPool, prompts: list[torch.Tensor], max_new_tokens: int
) -> NaiveRun:
    started = time.perf_counter()
    rows, start = len(prompts), pool.num_tokens
    ids, mask, positions = _left_padded(prompts, start)
    cache = StaticCache(config=model.config, max_cache_len=start + ids.shape[1] + max_new_tokens)
    for layer_idx in range(pool.num_layers):
        keys, values = pool.decompress_layer(layer_idx, dtype=model.dtype, device=model.device)
        cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer_idx)  # N copies, once
    keyword = cache_keyword(model)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1, **{keyword: cache})
    generated = []
    for step in range(max_new_tokens):
        next_ids = logits.logits[:, -1].argmax(-1, keepdim=True)  # [N, 1]
        generated.append(next_ids)
        if step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=-1)
        positions = positions[:, -1:] + 1
        logits = model(input_ids=next_ids, attention_mask=mask, position_ids=positions, **{keyword: cache})
    seconds = time.perf_counter() - started
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in layer_key_values(cache))
    return NaiveRun(token_ids=torch.cat(generated, dim=-1), seconds=seconds, kv_bytes=kv_bytes)
