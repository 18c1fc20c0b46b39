"""One thread runs the library's tensor work, so that the CPU's OpenMP runtime keeps one team of threads.

Why one thread. PyTorch's CPU kernels run their parallel regions on OpenMP (libgomp). Each thread that
starts a parallel region gets a team of its own, which lives as long as that thread, and once the
process has more OpenMP-managed threads than CPUs, libgomp cuts the time its idle helpers spin from
about 3 ms to 100 iterations (its ``gomp_throttled_spin_count_var``; no environment variable raises it
again). From then on every parallel region wakes its helpers through the kernel, and a decode step is
about a thousand short regions. ``python -m benchmarks dtype`` measures what that costs a forward
(docs/RUNTIME.md, "One compute thread").

So the model's forwards of every scheduler, the pool prefill, the private runtime and model loading
are handed to this one thread (:func:`run_on_compute_thread`) and their callers wait. Work from many
callers interleaves here at the granularity it is submitted in: one batched decode step, one prefill
chunk. A call made from the compute thread itself runs inline.

Tensor work a user runs on their own threads starts teams of its own and slows the process down in
the same way; run it through :func:`run_on_compute_thread` too. Work handed over must not wait for
the library (an agent's answer, a pool being built): that work needs this same thread, and would wait
behind it for ever.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

THREAD_NAME = "polykv-compute"


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, in submission order."""

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):  # a forked child has no compute thread: it starts its own
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], object]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread:
        """The thread (started on first use)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
                self._thread.start()
            return self._thread

    def run(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` on this thread, under the caller's autograd mode; its result or its exception."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        # Grad and inference mode are per thread: the job gets the caller's.
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def job() -> R:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn(*args, **kwargs)

        future: Future = Future()
        thread = self.thread
        self._jobs.put((future, job))
        if not thread.is_alive():  # pragma: no cover - only if the interpreter is shutting down
            msg = "the compute thread has stopped (the interpreter is shutting down)"
            raise RuntimeError(msg)
        return future.result()

    def _serve(self) -> None:
        while True:
            future, job = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as e:
                future.set_exception(e)


_COMPUTE = ComputeThread()


def run_on_compute_thread(fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """Run ``fn(*args, **kwargs)`` on the process's compute thread and return its result (see the module doc)."""
    return _COMPUTE.run(fn, *args, **kwargs)


def compute_thread() -> threading.Thread:
    """The process's compute thread (started on first use)."""
    return _COMPUTE.thread
