"""Probe: decode-shaped attention over a shared prefix, PyTorch's fused CPU kernel against two bf16 matmuls.

The cascade runtime's prefix part is ``[1, KVH, rows, D]`` queries (rows = agents x query heads per kv head)
against ``[1, KVH, T, D]`` keys and values. This times both ways over 30 distinct layers (so the prefix is read
from memory, as in a real step, not from cache) and prints microseconds per layer, two rounds each:

    python benchmarks/probes/decode_attention.py

Measured 2026-12-02 on this project's 2-core machine, SmolLM2-135M's shapes (3 kv heads, 64 dims, T = 4096),
bf16: 3 rows (1 agent) 472 vs 301 us; 45 rows (15 agents) 1427 vs 788-3139 us, the matmul path bimodal with
glibc's allocator (788 with MALLOC_MMAP_THRESHOLD_ raised, which real decode runs do not need: their page faults
are 1-263 per 32-token run). Inside an eager decode step the matmul path's separate softmax operators ate the
gain (profile: attention 26 ms instead of 44 ms at 15 agents, other operators +10 ms, step 101-110 ms against
98-116 ms); a fused kernel (compiled, or a C++ one) is what it needs. Not used by the runtime.
"""

from __future__ import annotations

import time

import torch

LAYERS = 30
KV_HEADS, HEAD_DIM, TOKENS = 3, 64, 4096


def fused(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, False, scale=HEAD_DIM**-0.5)


def matmuls(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * HEAD_DIM**-0.5
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    torch.matmul(weights.to(values.dtype), values).float() / weights.sum(dim=-1, keepdim=True)


def per_layer_us(attend, query: torch.Tensor, keys: list, values: list, rounds: int = 6) -> float:
    """Microseconds per layer of ``attend`` over all layers in turn, after a warm-up."""
    for _ in range(3):
        for layer in range(LAYERS):
            attend(query, keys[layer], values[layer])
    started = time.perf_counter()
    for _ in range(rounds):
        for layer in range(LAYERS):
            attend(query, keys[layer], values[layer])
    return (time.perf_counter() - started) / rounds / LAYERS * 1e6


def main() -> None:
    torch.set_num_threads(2)
    for dtype in (torch.bfloat16, torch.float32):
        keys = [torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]
        values = [torch.randn_like(k) for k in keys]
        for rows in (3, 12, 45, 96):
            query = torch.randn(1, KV_HEADS, rows, HEAD_DIM, dtype=dtype)
            timed = [
                (per_layer_us(fused, query, keys, values), per_layer_us(matmuls, query, keys, values)) for _ in "ab"
            ]
            shown = "  ".join(f"fused {a:.0f} us, matmuls {b:.0f} us" for a, b in timed)
            print(f"{dtype!s:15} rows {rows:3}: {shown}", flush=True)


if __name__ == "__main__":
    main()
