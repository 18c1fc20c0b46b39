"""Cascade attention of several groups in one native call (:mod:`polykv_agents.kernels`), where it applies.

A group is one :class:`~polykv_agents.runtime.cascade_attention.CascadeContext`'s rows: ``rows`` rows of
``width`` query tokens over one shared prefix and the rows' own suffixes. A step over one pool has one or two
groups (running rows, an admission chunk); a step shared by several pools has one or two per pool. The kernel
computes what :func:`~polykv_agents.runtime.cascade_attention.cascade_attention_forward` computes for each
group (same masks, same log-sum-exp merge, float32 sums) in one call per layer, so a group's cost no longer
includes ~170 small PyTorch operations.

Which groups it takes is decided per group, from that group alone (:func:`kernel_takes`), so a row is computed
the same way whether its pool steps alone or beside others: greedy tokens stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polykv_agents.kernels import TILES_SWITCH, kernel_tiles_available, native_kernel, switched_on
from polykv_agents.runtime.stored_prefix import StoredLayer

KERNEL_MAX_QUERIES = 24
"""Queries per kv head (rows x width x query heads per kv head) up to which a group goes to the kernel: 8 rows of
SmolLM2 (3 query heads per kv head). Beyond it PyTorch's fused kernel, one matrix product per key block for all
the queries, catches up: one layer over 2,048 keys took about as long either way at 12 and 16 rows, 1.2x less
with the kernel at 8 rows and 1.8-2x less at 2 to 4 (``benchmarks/probes/grouped_attention.py``), and in a whole
step of 16 rows over one pool the fused kernel was ahead (``python -m benchmarks shared_step_profile`` at 895e863).
An admission chunk of 128 tokens is far past it. A prefix kept as the pool stores it goes to the kernel at any
count: the other way decodes the whole layer first."""

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

PROFILE_LABEL = "polykv::grouped_attention"
"""The ``torch.profiler`` range of one kernel call (a native call is no ATen operator: without it the profile
would count its time as outside operators)."""


@dataclass(frozen=True)
class KernelGroup:
    """One group's inputs: ``query [H, rows*width, D]`` in (row, token) order, ``prefix`` keys/values
    ``[1, KVH, T, D]`` (``None`` with a ``stored`` prefix, read as the pool holds it), ``suffix`` keys/values
    ``[rows, KVH, S, D]`` (after this step's write), and per row ``starts`` (left padding) and ``past`` (slots
    filled before this step)."""

    query: torch.Tensor
    prefix_keys: torch.Tensor | None
    prefix_values: torch.Tensor | None
    suffix_keys: torch.Tensor
    suffix_values: torch.Tensor
    starts: torch.Tensor
    past: torch.Tensor
    width: int
    stored: StoredLayer | None = None


def kernel_takes(
    query: torch.Tensor, keys: torch.Tensor, queries_per_kv_head: int, kwargs: dict, *, stored: bool = False
) -> bool:
    """Whether a group of ``queries_per_kv_head`` queries with suffix ``keys`` goes to the kernel (over a
    ``stored`` prefix: at any count): on CPU, in inference, in a dtype it has, with no sliding window or
    soft-capping (those run in PyTorch), outside ``torch.compile``, and where the kernel is built."""
    return (
        (stored or queries_per_kv_head <= KERNEL_MAX_QUERIES)
        and query.device.type == "cpu"
        and query.dtype in KERNEL_DTYPES
        and keys.dtype == query.dtype
        and not query.requires_grad
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
        and not torch.compiler.is_compiling()
        and native_kernel("grouped_attention") is not None
    )


def grouped_attention(groups: list[KernelGroup], scaling: float, *, tiles: bool | None = None) -> torch.Tensor:
    """``[sum of rows*width, H, D]``: each group's attention output, groups in order, in the query's dtype.

    ``tiles``: bfloat16 groups use AMX tile products where the CPU has them (:func:`tiles_available`); ``False``
    keeps every group on the vector path; ``None``: as ``POLYKV_AGENTS_TILES`` says (on unless ``0``)."""
    kernel = native_kernel("grouped_attention")
    tiles = switched_on(TILES_SWITCH) if tiles is None else tiles
    query = groups[0].query if len(groups) == 1 else torch.cat([g.query for g in groups], dim=1)
    none = query.new_empty(0)  # a stored group's decoded prefix, which it has not
    with torch.profiler.record_function(PROFILE_LABEL):
        return kernel.grouped_attention(
            query,
            float(scaling),
            [none if g.stored else g.prefix_keys[0] for g in groups],
            [none if g.stored else g.prefix_values[0] for g in groups],
            [g.suffix_keys for g in groups],
            [g.suffix_values for g in groups],
            [g.starts for g in groups],
            [g.past for g in groups],
            [g.width for g in groups],
            [g.stored.kernel_tensors() if g.stored else [] for g in groups],
            tiles,
        )


def tiles_available() -> bool:
    """Whether the kernel computes bfloat16 groups with AMX tiles here (built for a CPU with AMX, granted by the OS,
    not switched off by ``POLYKV_AGENTS_TILES=0``); ``False`` where the kernel is not built."""
    return kernel_tiles_available("grouped_attention")
