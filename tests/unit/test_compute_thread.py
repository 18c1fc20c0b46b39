"""The compute thread: every forward the library runs happens on one thread (one OpenMP team), and a
caller gets the result, the exception and the autograd mode it would have had running the work itself."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from polykv_agents import GenerationSettings, PooledAgent, SharedKVPool
from polykv_agents.engine import Engine
from polykv_agents.model.compute_thread import compute_thread, run_on_compute_thread


def test_the_work_runs_on_the_one_compute_thread_and_returns_its_result():
    assert run_on_compute_thread(threading.current_thread) is compute_thread()
    assert run_on_compute_thread(lambda a, b=0: a + b, 2, b=3) == 5


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        run_on_compute_thread(fail)
    assert run_on_compute_thread(lambda: 7) == 7


def test_a_call_from_the_compute_thread_runs_inline():
    """No deadlock when work handed over hands work over again."""
    assert run_on_compute_thread(lambda: run_on_compute_thread(lambda: threading.current_thread())) is compute_thread()


@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_the_work_runs_under_the_caller_s_autograd_mode(mode):
    context = {"inference": torch.inference_mode(), "no_grad": torch.no_grad(), "grad": torch.enable_grad()}[mode]
    with context:
        seen = run_on_compute_thread(lambda: (torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
    assert seen == {"inference": (True, False), "no_grad": (False, False), "grad": (False, True)}[mode]


def test_callers_from_many_threads_are_served_one_at_a_time():
    active, overlaps = [0], []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            active[0] += 1
            overlaps.append(active[0])
        threading.Event().wait(0.002)
        with lock:
            active[0] -= 1
        return i

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda i: run_on_compute_thread(work, i), range(40))) == list(range(40))
    assert max(overlaps) == 1


def test_every_forward_and_sampling_of_prefill_batched_and_private_decoding_runs_on_the_compute_thread(
    tiny_tok, monkeypatch
):
    """Sampling too: a softmax over the vocabulary is large enough to start a parallel region."""
    from tiny_models import tiny_llama

    from polykv_agents.runtime import private, scheduler

    model = tiny_llama(seed=3)
    threads: set[str] = set()
    model.register_forward_pre_hook(lambda module, args: threads.add(threading.current_thread().name))
    for module in (private, scheduler):

        def recording(*args, _choose=module.choose_token, **kwargs):
            threads.add(threading.current_thread().name)
            return _choose(*args, **kwargs)

        monkeypatch.setattr(module, "choose_token", recording)
    pool = SharedKVPool.prefill(model, tiny_tok, "a shared document " * 8)
    engine = Engine()
    settings = GenerationSettings(max_new_tokens=4)
    for runtime in ("decompressed", "private"):
        agent = PooledAgent(pool, model, tiny_tok, system_prompt="You are terse.", runtime=runtime, engine=engine)
        with ThreadPoolExecutor(3) as callers:
            list(callers.map(lambda q, agent=agent: list(agent.generate_ids(q, settings)), ["a", "b", "c"]))
    engine.close()
    assert threads == {compute_thread().name}


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")
def test_a_forked_child_starts_afresh_without_the_parent_s_queued_work(tmp_path):
    """A child forked while the parent's compute thread is busy must not run the parent's queued work (a
    forward of the parent's, twice) before its own: it gets a new, empty queue and a thread of its own."""
    busy, release = threading.Event(), threading.Event()
    marker = tmp_path / "stale-job-ran"

    def blocking() -> None:
        busy.set()
        release.wait()

    with ThreadPoolExecutor(2) as callers:
        running = callers.submit(run_on_compute_thread, blocking)
        busy.wait()
        queued = callers.submit(run_on_compute_thread, marker.touch)  # waits behind the blocking job
        threading.Event().wait(0.05)  # let it reach the queue
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its own work ran, on its own thread, and nothing else did
            try:
                ok = run_on_compute_thread(lambda: threading.current_thread().name) == "polykv-compute"
                ok = ok and not marker.exists()
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        release.set()
        running.result()
        queued.result()
    assert os.waitstatus_to_exitcode(status) == 0
    assert marker.exists()  # the parent's own queued work still ran, in the parent
