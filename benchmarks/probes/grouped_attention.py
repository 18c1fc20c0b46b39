"""Probe: one layer of a step's cascade attention for P pools of R decode rows each, the native grouped kernel
(one call for all groups) against the PyTorch path (per group: the fused kernel over the prefix, the fused kernel
over the rows' suffixes, the log-sum-exp merge: what ``cascade_attention_forward`` runs per context).

SmolLM2-135M's shapes (3 kv heads, 3 query heads per kv head, 64 dims), bf16, prefixes of 2,048 tokens (each
pool a few tokens longer than the last), 150 suffix slots per row. Each configuration cycles over 30 distinct
layers' tensors, so that prefixes come from memory as in a real step, and prints milliseconds per layer, the median
of 5 rounds of 30 layers, and the largest difference between the two paths' outputs:

    python benchmarks/probes/grouped_attention.py

Run on 2026-12-06 with the kernel of 4ddbe84 (unchanged since), this project's 2-core machine type (Intel Xeon
here), one pool, 9 rounds (ms per layer, native / pytorch): 2 rows 0.414 / 0.819; 4 rows 0.509 / 0.915; 6 rows
0.779 / 1.048; 8 rows 0.540 / 0.666; 12 rows 0.799 / 0.807; 16 rows 0.861 / 0.919. Hence ``KERNEL_MAX_QUERIES``
(8 rows); in a whole profiled step of 16 rows the fused kernel was ahead (``shared_step_profile`` at 895e863).
Over 8 pools of 2 rows two earlier runs the same day, before the values were prefetched, gave 2.1-2.2 against
4.0 ms; the PyTorch path timed here includes the merge and casts that a profiled step counts as other operators.
"""

from __future__ import annotations

import statistics
import time

import torch

from polykv_agents.kernels import native_kernel
from polykv_agents.runtime.cascade_attention import _attend, _merge
from polykv_agents.runtime.grouped_attention import KernelGroup, grouped_attention

KV_HEADS, GROUPS, DIM, LAYERS = 3, 3, 64, 30
HEADS = KV_HEADS * GROUPS
DTYPE = torch.bfloat16


def _layer(pools: int, rows: int, prefix: int, suffix: int, gen: torch.Generator) -> list[KernelGroup]:
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DTYPE)

    groups = []
    for p in range(pools):
        past = torch.randint(suffix // 2, suffix, (rows,), generator=gen)
        prefix_keys, prefix_values = rand(1, KV_HEADS, prefix + 37 * p, DIM), rand(1, KV_HEADS, prefix + 37 * p, DIM)
        suffix_keys, suffix_values = rand(rows, KV_HEADS, suffix, DIM), rand(rows, KV_HEADS, suffix, DIM)
        query = rand(rows, HEADS, DIM).transpose(0, 1)  # [H, rows, D]
        starts = torch.zeros(rows, dtype=torch.int64)
        groups.append(KernelGroup(query, prefix_keys, prefix_values, suffix_keys, suffix_values, starts, past - 1, 1))
    return groups


def pytorch_path(groups: list[KernelGroup], scaling: float) -> torch.Tensor:
    """What the runtime runs per group without the kernel (decode rows: one query each)."""
    outs = []
    for g in groups:
        rows = g.suffix_keys.shape[0]
        query = g.query.transpose(0, 1).reshape(rows, HEADS, 1, DIM)
        grouped = query.reshape(rows, KV_HEADS, GROUPS, DIM).transpose(0, 1).reshape(1, KV_HEADS, rows * GROUPS, DIM)
        out_prefix, lse_prefix = _attend(grouped, g.prefix_keys, g.prefix_values, scaling)
        out_prefix = out_prefix.view(KV_HEADS, rows, GROUPS, DIM).transpose(0, 1)
        lse_prefix = lse_prefix.view(KV_HEADS, rows, GROUPS).transpose(0, 1)
        slots = torch.arange(g.suffix_keys.shape[2]).view(1, -1)
        visible = (slots <= g.past.view(-1, 1)) & (slots >= g.starts.view(-1, 1))  # its new token is at slot past
        visible = visible.view(rows, 1, 1, -1).expand(rows, 1, GROUPS, -1)
        additive = torch.zeros(visible.shape, dtype=DTYPE).masked_fill_(~visible, -torch.inf)
        out_suffix, lse_suffix = _attend(query.reshape(rows, KV_HEADS, GROUPS, DIM), g.suffix_keys, g.suffix_values,
                                         scaling, bool_mask=visible, additive_mask=additive)  # fmt: skip
        out, _, _ = _merge((out_prefix, lse_prefix), (out_suffix, lse_suffix))
        outs.append(out.reshape(rows, HEADS, DIM).to(DTYPE))
    return torch.cat(outs)


def _ms_per_layer(method, layers: list[list[KernelGroup]]) -> float:
    rounds = []
    for _ in range(6):
        start = time.perf_counter()
        for groups in layers:
            method(groups, 0.125)
        rounds.append((time.perf_counter() - start) / len(layers) * 1000)
    return statistics.median(rounds[1:])  # the first round warms up


def main() -> None:
    if native_kernel("grouped_attention") is None:
        raise SystemExit("the native kernel is not built here (POLYKV_AGENTS_KERNELS=0, or no g++/ninja)")
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, bf16, prefix 2,048+, ms per layer (median of 5 rounds of 30 layers)")
    for pools, rows in [(1, 1), (1, 3), (1, 16), (2, 4), (4, 4), (8, 2), (8, 4), (16, 1)]:
        layers = [_layer(pools, rows, 2048, 150, gen) for _ in range(LAYERS)]
        native, fallback = _ms_per_layer(grouped_attention, layers), _ms_per_layer(pytorch_path, layers)
        diff = (grouped_attention(layers[0], 0.125).float() - pytorch_path(layers[0], 0.125).float()).abs().max()
        print(f"{pools:>2} pools x {rows:>2} rows: native {native:.3f}  pytorch {fallback:.3f}  "
              f"({fallback / native:.2f}x)  max diff {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
