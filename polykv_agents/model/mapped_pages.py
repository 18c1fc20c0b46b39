"""Dropping a checkpoint's pages from the resident set once the weights that mapped them are replaced.

transformers reads a safetensors checkpoint in its own dtype by mapping the file: each weight is a view of the file's
pages (a private mapping, no copy). Quantizing the linear layers reads every one of those pages, and a page once read
stays in this process's RSS for as long as the mapping lives, which is until the last weight of the file is
gone. So quantizing a model peaked at the whole file *plus* its quantized copy: 4,523 MiB at the load of
Llama-3.2-1B's 2.5 GB bf16 file with int8 weights before this module, 2,486 MiB with it
(``benchmarks/probes/load_memory.py``; ``benchmarks/results/issue43``).

:func:`release_mapped_pages` asks the kernel to reclaim the pages of a replaced weight (``madvise(MADV_PAGEOUT)``,
Linux 5.4 and later). Nothing can be lost: a clean page of the file leaves the resident set (it is still in the file,
and a read would fault it in again), and a page that was written in place (a private copy) is kept, as reclaim
would need swap for it; a page of a file saved moments before and not yet written back is written back first, and
stays resident until then. ``MADV_DONTNEED`` would drop a written copy too, and would zero heap memory. It is asked only
for a tensor that lies wholly in a mapping of a regular file, only for its whole pages (a page it shares with a
neighbour stays), and only on Linux; the caller releases only a weight no module holds any more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import torch

_MADV_PAGEOUT = 21  # Linux's value (asm-generic/mman-common.h), since 5.4


@functools.cache
def _madvise():
    """libc's ``madvise``, typed, or ``None`` where there is none."""
    name = ctypes.util.find_library("c")
    try:
        madvise = ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    return madvise


def file_mappings() -> list[tuple[int, int]]:
    """``[(start, end)]`` address ranges of this process's mappings of regular files (``/proc/self/maps``; none
    elsewhere than Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.startswith("/") and not path.startswith("/dev/") and not path.endswith("(deleted)"):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def release_mapped_pages(tensor: torch.Tensor, mappings: list[tuple[int, int]] | None = None) -> int:
    """Drop the whole pages of ``tensor``'s bytes from the resident set if they map a file; the bytes released
    (0: not a file's pages, not contiguous, not Linux, or less than a page). ``mappings``: :func:`file_mappings`,
    read once by a caller releasing many tensors. The caller releases only a weight that nothing reads any more."""
    madvise = _madvise()
    if not sys.platform.startswith("linux") or madvise is None or tensor.device.type != "cpu":
        return 0
    if not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()  # the tensor's own bytes, never the rest of a storage it may share
    end = start + tensor.numel() * tensor.element_size()
    if mappings is None:
        mappings = file_mappings()
    if not any(low <= start and end <= high for low, high in mappings):
        return 0  # not a file's pages: nothing to give back without swap
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first or madvise(first, last - first, _MADV_PAGEOUT) != 0:
        return 0
    return last - first
