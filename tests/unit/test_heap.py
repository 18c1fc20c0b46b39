"""Giving the C heap's free memory back to the system (glibc's ``malloc_trim``), and doing nothing elsewhere."""

from __future__ import annotations

import ctypes.util
import sys

import pytest
import torch

from polykv_agents.model import heap


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc")
def test_free_blocks_between_live_ones_are_handed_back():
    heap.release_free_heap()
    kept, freed = [], []
    for i in range(400):  # 64 KB blocks come from the heap, not from a mapping of their own
        (kept if i % 2 else freed).append(torch.empty(16_000, dtype=torch.float32))
    del freed  # 200 holes between live blocks: free, but resident until trimmed
    assert heap.release_free_heap()
    assert len(kept) == 200


def test_without_malloc_trim_it_does_nothing(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert heap.release_free_heap() is False
