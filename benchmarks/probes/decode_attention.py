"""Probe: decode-shaped attention over a shared prefix, PyTorch's fused CPU kernel against two bf16 matmuls and
against the runtime's reduced formulation compiled by Inductor (what compiled decode steps run for few queries).

The cascade runtime's prefix part is ``[1, KVH, rows, D]`` queries (rows = agents x query heads per kv head)
against ``[1, KVH, T, D]`` keys and values. This times the three ways over 30 distinct layers (so the prefix is
read from memory, as in a real step, not from cache) and prints microseconds per layer, two rounds each:

    python benchmarks/probes/decode_attention.py

Measured 2026-12-02 on this project's 2-core machine, SmolLM2-135M's shapes (3 kv heads, 64 dims, T = 4096),
bf16: 3 rows (1 agent) 472 vs 301 us; 45 rows (15 agents) 1427 vs 788-3139 us, the matmul path bimodal with
glibc's allocator (788 with MALLOC_MMAP_THRESHOLD_ raised, which real decode runs do not need: their page faults
are 1-263 per 32-token run). Inside an eager decode step the matmul path's separate softmax operators ate the
gain (profile: attention 26 ms instead of 44 ms at 15 agents, other operators +10 ms, step 101-110 ms against
98-116 ms); a fused kernel (compiled, or a C++ one) is what it needs. The matmul path is not used by the runtime;
its bf16 score matrix also rounds the scores, which the other two keep in float32.

The reduced formulation (``_attend_reduced``, compiled): Inductor writes each product-and-sum as one loop that
reads the keys once and accumulates in float32. This script, 2026-12-02 at d909f6c, bf16, two rounds each
(fused / reduced, us per layer): 3 rows 502-643 / 270-341; 6 rows 657-668 / 462-472; 12 rows 764-944 / 645-752;
45 rows 1759-1926 / 2396-2457 (float32: 3 rows 704-750 / 446-493, 6 rows even, 12 and 45 rows fused ahead). It
wins for few queries per kv head only, hence the runtime's ``REDUCED_MAX_QUERIES`` (6; 12 rows were about even in
an earlier run of the same shapes, so the threshold stays at one or two agents of SmolLM2). Inside the compiled
step it first gained nothing (27.4 -> 28.1 ms per step, one agent, 4K, int8 weights): Inductor had inlined the
query's rotary embedding, a cos and a sin per element, into the loop over the keys. Writing the query to memory
first (``_computed_once``) made it 17.5 ms (``benchmarks/probes/compiled_step_ms.py``).

In halves (``_attend_reduced_in_halves``, what compiled steps now run for the prefix, so that no float32 sum
runs over more than 4,096 keys): this script, 2026-12-02 at a644de3, bf16, two rounds each (reduced / halves, us
per layer): 3 rows 580-364 / 357-357; 6 rows 587-658 / 562-640; 12 rows 1203-1343 / 1091-1158. No cost beyond
the noise of this machine (whose fused kernel took 527-553 us at 6 rows in the same run).
"""

from __future__ import annotations

import time

import torch

from polykv_agents.runtime.cascade_attention import _attend_reduced, _attend_reduced_in_halves

LAYERS = 30
KV_HEADS, HEAD_DIM, TOKENS = 3, 64, 4096


def fused(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, False, scale=HEAD_DIM**-0.5)


def matmuls(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * HEAD_DIM**-0.5
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    torch.matmul(weights.to(values.dtype), values).float() / weights.sum(dim=-1, keepdim=True)


_REDUCED = torch.compile(_attend_reduced, dynamic=False)
_HALVES = torch.compile(_attend_reduced_in_halves, dynamic=False)


def reduced(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    _REDUCED(query, keys, values, HEAD_DIM**-0.5)


def halves(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    _HALVES(query, keys, values, HEAD_DIM**-0.5)


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
        for rows in (3, 6, 12, 45):
            query = torch.randn(1, KV_HEADS, rows, HEAD_DIM, dtype=dtype)
            ways = (fused, matmuls, reduced, halves)
            timed = [[per_layer_us(attend, query, keys, values) for attend in ways] for _ in "ab"]
            shown = "  ".join(
                f"fused {a:.0f} us, matmuls {b:.0f} us, reduced {c:.0f} us, halves {d:.0f} us" for a, b, c, d in timed
            )
            print(f"{dtype!s:15} rows {rows:3}: {shown}", flush=True)


if __name__ == "__main__":
    main()
