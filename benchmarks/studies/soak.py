"""Soak: many workflow runs in one process, with process memory and live tensors sampled as they go.

Data flow of :func:`run_soak`:
  for each run: a fresh document (so every run builds a new pool, as a server reading new documents
  does) -> ``graph.invoke`` -> every ``sample_every`` runs: ``gc.collect()``, process RSS (psutil),
  and the number and bytes of live ``torch.Tensor`` objects (found through the garbage collector)
  -> :class:`SoakSample` rows, from which :func:`growth` reports what grew after the warm-up.

Growth is measured from the first sample after ``warmup_runs`` (allocator pools, caches of compiled
kernels and the registry's budget fill up during the warm-up) to the last sample.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil
import torch


@dataclass(frozen=True)
class SoakSample:
    run: int
    """Workflow runs completed when the sample was taken."""
    seconds: float
    rss_bytes: int
    live_tensors: int
    live_tensor_bytes: int
    threads: int


def live_tensors() -> tuple[int, int]:
    """``(count, bytes)`` of the ``torch.Tensor`` objects alive in this process (model weights included)."""
    count = nbytes = 0
    with warnings.catch_warnings():  # isinstance() touches deprecated torch.distributed aliases
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                count += 1
                # A symbolic-shape tensor (left by torch.compile tracing) has no storage and no nbytes.
                with contextlib.suppress(RuntimeError):
                    nbytes += obj.nbytes if not obj.is_meta else 0
    return count, nbytes


def _sample(run: int, started: float, process: psutil.Process) -> SoakSample:
    gc.collect()
    count, nbytes = live_tensors()
    return SoakSample(
        run, time.perf_counter() - started, process.memory_info().rss, count, nbytes, process.num_threads()
    )


def run_soak(
    invoke: Callable[[int], Mapping[str, Any]],
    *,
    runs: int,
    sample_every: int = 10,
    check: Callable[[int, Mapping[str, Any]], None] | None = None,
) -> list[SoakSample]:
    """Call ``invoke(run)`` for ``run = 0 .. runs-1``; ``check(run, result)`` may assert on each result."""
    process = psutil.Process()
    started = time.perf_counter()
    samples = [_sample(0, started, process)]
    for run in range(runs):
        result = invoke(run)
        if check is not None:
            check(run, result)
        if (run + 1) % sample_every == 0 or run + 1 == runs:
            samples.append(_sample(run + 1, started, process))
    return samples


@dataclass(frozen=True)
class SoakGrowth:
    from_run: int
    to_run: int
    rss_bytes: int
    live_tensors: int
    live_tensor_bytes: int
    threads: int


def growth(samples: list[SoakSample], warmup_runs: int) -> SoakGrowth:
    """What grew between the first sample at or after ``warmup_runs`` and the last sample."""
    base = next(s for s in samples if s.run >= warmup_runs)
    last = samples[-1]
    return SoakGrowth(
        from_run=base.run,
        to_run=last.run,
        rss_bytes=last.rss_bytes - base.rss_bytes,
        live_tensors=last.live_tensors - base.live_tensors,
        live_tensor_bytes=last.live_tensor_bytes - base.live_tensor_bytes,
        threads=last.threads - base.threads,
    )
