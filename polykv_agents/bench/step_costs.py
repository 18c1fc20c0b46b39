"""What one decode step costs, for the speed suite and docs/RUNTIME.md: measured, never estimated.

- :func:`attention_kernel_rows`: the prefix part of cascade attention for one layer, PyTorch's fused CPU
  kernel against the matmul-softmax-matmul fallback, at the shapes of a decode step and of an admission
  prefill of N agents;
- :func:`step_intervals_ms`: the time between consecutive tokens of agents decoding at once through the
  runtime (one batched step each), as users get it, on the compute thread.

What a second thread's tensor work costs every later step is measured by the repository's dtype study, in fresh
processes (:mod:`benchmarks.studies.openmp_teams`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import PreTrainedModel

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.stats import median_after_warmup
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.runtime.cascade_attention import _attend, _attend_unfused
from polykv_agents.sampling.settings import GenerationSettings


def median_ms_on_compute_thread(repetitions: int, work: Callable[[], object]) -> float:
    """Median milliseconds of ``work`` after a warm-up, on the compute thread (timed there: the hand-over
    is not the work's cost), where the runtime runs it; on any other thread it would start a second
    OpenMP team and slow down everything measured after it."""

    def milliseconds() -> float:
        started = time.perf_counter()
        work()
        return 1000 * (time.perf_counter() - started)

    return median_after_warmup(repetitions, lambda: run_on_compute_thread(milliseconds))


def _head_dims(model: PreTrainedModel) -> tuple[int, int, int]:
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, config.num_key_value_heads, head_dim


def attention_kernel_rows(
    model: PreTrainedModel, *, context: int, agents: int, prompt_tokens: int, repetitions: int
) -> list[dict]:
    """One row per shape (decode step, admission): ms per layer, fused and unfused; inputs made and timed on
    the compute thread."""
    return run_on_compute_thread(
        _attention_kernel_rows, model, context=context, agents=agents, prompt_tokens=prompt_tokens,
        repetitions=repetitions,
    )  # fmt: skip


@torch.inference_mode()
def _attention_kernel_rows(
    model: PreTrainedModel, *, context: int, agents: int, prompt_tokens: int, repetitions: int
) -> list[dict]:
    heads, kv_heads, head_dim = _head_dims(model)
    groups = heads // kv_heads
    keys = torch.randn(1, kv_heads, context, head_dim, dtype=model.dtype)
    values = torch.randn_like(keys)
    scaling = head_dim**-0.5
    rows = []
    for shape, q_len in (("decode step", 1), ("admission prefill", prompt_tokens)):
        query = torch.randn(1, kv_heads, agents * groups * q_len, head_dim, dtype=model.dtype)
        fused = median_ms_on_compute_thread(repetitions, lambda q=query: _attend(q, keys, values, scaling))
        unfused = median_ms_on_compute_thread(repetitions, lambda q=query: _attend_unfused(q, keys, values, scaling))
        rows.append(
            {
                "kind": "kernel",
                "shape": shape,
                "context_tokens": context,
                "agents": agents,
                "query_tokens_per_agent": q_len,
                "ms_per_layer_fused": fused,
                "ms_per_layer_unfused": unfused,
                "speedup": unfused / fused,
            }
        )
    return rows


def step_intervals_ms(agents: Sequence[PooledAgent], questions: Sequence[str], settings: GenerationSettings) -> float:
    """Median ms between consecutive tokens of each agent, all decoding at once (admission excluded)."""
    arrivals: list[list[float]] = [[] for _ in agents]

    def answer(i: int) -> None:
        for _ in agents[i].generate_ids(questions[i], settings):
            arrivals[i].append(time.perf_counter())

    with ThreadPoolExecutor(max_workers=len(agents)) as executor:
        list(executor.map(answer, range(len(agents))))
    gaps = [1000 * (b - a) for times in arrivals for a, b in itertools.pairwise(times)]
    return statistics.median(gaps)
