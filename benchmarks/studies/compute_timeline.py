"""Where the compute thread's time goes while a workload runs: every job it runs, timed and named, and for the
scheduler's steps the prompt tokens they prefilled and the tokens they sampled.

Every forward of the library runs on one thread (:mod:`polykv_agents.model.compute_thread`), one job at a time,
so the jobs' durations add up to the time that thread was busy, and the rest of a run's wall time is time it
waited (for Python outside it: graph nodes, tokenization, the gather of a shared step). A job is a step of the
schedulers (:meth:`~polykv_agents.runtime.model_steps.ModelSteps._run_ready`: one forward for every pool ready,
or one pool's own step) or other work: a chunk of a document's prefill, one layer's compression, a pool decoded
for a scheduler. Steps are split by what they did: a step that prefilled prompt tokens (an admission's chunk,
packed or alone) is a *prompt step*, one that only sampled the running rows' next tokens a *decode step*.

This is a measuring harness, not the library's code: :class:`ComputeTimeline` wraps the compute thread's
``run`` and two methods of the scheduler for as long as it is entered, and restores them on exit.

Data flow: ``with ComputeTimeline() as timeline`` -> jobs recorded as :class:`Job` (start, end, kind, prompt
tokens, sampled tokens) -> :func:`where_time_goes` sums those inside a window (a run's wall time) by kind.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

STEP_KINDS = ("prompt steps", "decode steps")
"""What a scheduler step did: prefilled prompt tokens (and maybe sampled running rows), or sampled only."""

JOB_LABELS = {
    "ModelSteps._run_ready": "step",
    "_forward_with_cache": "document prefill",
    "_encode_layer": "pool compression",
    "SharedPrefix": "pool decode for a scheduler",
    "SharedKVPool.decompress_layer": "pool decode",
}
"""A compute-thread job's function (``__qualname__``) -> what the table calls it; other jobs keep their name."""


@dataclass
class Job:
    """One job of the compute thread: when it ran (``time.perf_counter`` seconds), what it was, and for a step the
    prompt token slots it prefilled (``[rows, columns]`` of its chunks, padding included) and the tokens it
    sampled."""

    start: float
    end: float = 0.0
    label: str = ""
    prompt_tokens: int = 0
    sampled_tokens: int = 0

    @property
    def kind(self) -> str:
        if self.label != "step":
            return self.label
        return STEP_KINDS[0] if self.prompt_tokens else STEP_KINDS[1]


class ComputeTimeline:
    """Records every job of the compute thread while entered (see the module's docstring)."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self._current: Job | None = None  # the job the compute thread is running
        self._depth = threading.local()
        self._restore: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> ComputeTimeline:
        from polykv_agents.model import compute_thread
        from polykv_agents.runtime.admission import Admission
        from polykv_agents.runtime.scheduler import BatchScheduler

        compute = compute_thread._COMPUTE
        run, chunk, emit = compute.run, Admission.chunk, BatchScheduler._emit
        timeline = self

        def timed_run(fn, /, *args, **kwargs):
            return run(timeline._timed(fn), *args, **kwargs)

        def counted_chunk(admission, columns):
            ids = chunk(admission, columns)  # [A, columns]
            if timeline._current is not None:
                timeline._current.prompt_tokens += ids.numel()
            return ids

        def counted_emit(scheduler, request, logits):
            produced = request.produced
            emit(scheduler, request, logits)
            if timeline._current is not None:
                timeline._current.sampled_tokens += request.produced - produced

        self._restore = [(compute, "run", None), (Admission, "chunk", chunk), (BatchScheduler, "_emit", emit)]
        compute.run = timed_run  # an instance attribute: shadows the method until deleted
        Admission.chunk, BatchScheduler._emit = counted_chunk, counted_emit
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._restore:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore = []

    def _timed(self, fn):
        """``fn``, recorded as a job when it is the compute thread's outermost call (a call it makes from inside a
        job runs inline and is part of that job)."""
        name = getattr(fn, "__qualname__", type(fn).__name__)

        def job(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth:
                return fn(*args, **kwargs)
            self._depth.value = 1
            record = Job(start=time.perf_counter(), label=JOB_LABELS.get(name, name))
            self._current = record
            try:
                return fn(*args, **kwargs)
            finally:
                record.end = time.perf_counter()
                self._current, self._depth.value = None, 0
                self.jobs.append(record)

        return job


def where_time_goes(jobs: list[Job], start: float, end: float) -> dict[str, Any]:
    """The jobs inside ``[start, end]`` (clipped to it), summed by kind: seconds, jobs, prompt tokens and sampled
    tokens per kind, the thread's busy seconds, and ``idle_s``, the window's time the thread ran nothing."""
    kinds: dict[str, dict[str, float]] = {}
    busy = 0.0
    for job in jobs:
        seconds = min(job.end, end) - max(job.start, start)
        if seconds <= 0:
            continue
        figures = kinds.setdefault(job.kind, {"seconds": 0.0, "jobs": 0, "prompt_tokens": 0, "sampled_tokens": 0})
        figures["seconds"] += seconds
        figures["jobs"] += 1
        figures["prompt_tokens"] += job.prompt_tokens
        figures["sampled_tokens"] += job.sampled_tokens
        busy += seconds
    return {"wall_s": end - start, "busy_s": busy, "idle_s": end - start - busy, "kinds": kinds}
