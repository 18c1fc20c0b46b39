"""Giving the C heap's free memory back to the system after work that leaves much of it free.

PyTorch's CPU tensors come from the C allocator. On glibc, a freed block below the mmap threshold (which grows to
32 MiB as large blocks are freed) stays in the heap: free, but counted in the process's RSS until ``malloc_trim``
hands its pages back. Two places leave a lot of it: quantizing weights (each matrix passes through float32 on the
way to int8), and a burst of calls (their caches, logits and scratch). Measured by
``python -m benchmarks.probes.rss_census``: 433 MiB free in the heap after loading the embedded model with int8
weights, 150-290 MiB after the 15-role reviews at 4,096 tokens.

:func:`release_free_heap` is called after loading a model and when an idle scheduler retires, never on the decode
path. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``); whether any were released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
