"""One forward per step for every pool a model serves: the running rows and admission chunks of all of one
model's schedulers go through the model together.

Why. A decode step of a small model on a CPU costs about the same for 1 row as for 15: it reads every weight
once and pays about a thousand small operations either way. A scheduler batches the calls over ONE pool; with
several documents (several workflows served by one process), each scheduler ran a forward of its own on the one
compute thread, so N workflows took N forwards per step. Here the schedulers of one model share a step: one
packed forward (:mod:`.packed_step`) in which every linear layer runs once for all rows, and attention runs per
group, each group against its own pool's prefix and its own rows' suffixes, so each row sees exactly what it
sees alone.

How a step is gathered. A scheduler's worker thread calls :meth:`ModelSteps.step` when it has work. The first to
arrive leads: it hands one job to the compute thread, which waits (at most :attr:`~ModelSteps.gather_seconds`)
for the model's other busy schedulers (rows decoding, an admission under way or requests waiting; each comes
back for its next step within microseconds of its last, or of a submit) and then runs every scheduler that has
arrived. The others wait, in :meth:`~ModelSteps.step`, until a leader has run their part. A scheduler that is
alone in its step runs it as it always has (its compiled decode step included): packing starts at two pools.

Fairness. Every busy pool is in every step, so no pool waits behind another's rows; the admission chunk budget of
a step is shared among the pools admitting in it, so several long prompts arriving at once hold the running rows
up no longer than one would.

Failure. A failed shared forward cannot be pinned on one group. No cache was advanced, so each scheduler then
runs its step again on its own, and only a group that fails alone fails its rows.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.runtime.packed_step import StepPart, pack_parts

if TYPE_CHECKING:  # the scheduler imports this module
    from polykv_agents.runtime.scheduler import BatchScheduler

logger = logging.getLogger(__name__)

GATHER_SECONDS = 0.005
"""How long a step waits for the model's other busy schedulers to arrive. Each comes back for its next step
within microseconds of its last; this bounds the wait for one that is stuck elsewhere (closing, or its thread
not scheduled), against decode steps of tens of milliseconds."""

SHARED_STEP_LABEL = "polykv::shared_step"
"""The ``torch.profiler`` range of a step that runs several pools' rows in one forward."""


@dataclass
class SharedPart:
    """One scheduler's part of a shared step: its packed parts (its running rows, then its admission's next
    chunk), how many running rows lead them, and how many prompt columns the chunk holds (0: none)."""

    scheduler: BatchScheduler
    parts: list[StepPart]
    running: int
    columns: int

    @property
    def rows(self) -> int:
        """Logit rows this part gets back: one per running row and one per admitted row."""
        return sum(part.ids.shape[0] for part in self.parts)


class ModelSteps:
    """Gathers the steps of one model's schedulers into one forward (see the module's docstring).

    Args:
        gather_seconds: The longest a step waits for the model's other busy schedulers.
    """

    def __init__(self, gather_seconds: float = GATHER_SECONDS) -> None:
        self.gather_seconds = gather_seconds
        self._cond = threading.Condition()
        self._members: set[BatchScheduler] = set()
        self._ready: list[BatchScheduler] = []  # arrived, waiting for a step
        self._running: set[BatchScheduler] = set()  # in the step under way
        self._leading = False
        self.shared_steps = 0
        """Steps that ran more than one pool in one forward."""
        self.peak_pools_per_step = 0
        """The most pools one forward has served."""

    def join(self, scheduler: BatchScheduler) -> None:
        """Count ``scheduler`` among those a step waits for while it is busy."""
        with self._cond:
            self._members.add(scheduler)

    def leave(self, scheduler: BatchScheduler) -> None:
        """Stop waiting for ``scheduler`` (closed or retired)."""
        with self._cond:
            self._members.discard(scheduler)
            self._cond.notify_all()

    def step(self, scheduler: BatchScheduler) -> None:
        """Run ``scheduler``'s next step, in one forward with every other scheduler of the model that is ready;
        returns once it has run (from its worker thread). The worker stays here until then: its scheduler's inbox
        and admission are the compute thread's to change meanwhile, and a worker that left early could find its
        inbox emptied before the admission is set, and wait for work for ever."""
        with self._cond:
            self._ready.append(scheduler)
            self._cond.notify_all()
            while scheduler in self._ready or scheduler in self._running:
                if not self._leading and scheduler in self._ready:
                    self._leading = True
                    break
                self._cond.wait()
            else:
                return  # a leader's step ran it
        try:
            run_on_compute_thread(self._run_ready)
        finally:
            with self._cond:
                self._leading = False
                self._cond.notify_all()

    def _run_ready(self) -> None:
        """On the compute thread: wait for the busy members still to come, then run everyone who is ready."""
        deadline = time.monotonic() + self.gather_seconds
        with self._cond:
            while True:
                missing = [m for m in self._members if m.busy and m not in self._ready]
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch, self._ready = self._ready, []
            self._running = set(batch)
        try:
            if len(batch) == 1:
                batch[0].run_step()
            else:
                self._shared_step(batch)
        except Exception as e:  # unforeseen: every call of the step ends with the error rather than waiting for ever
            logger.error("a step shared by %d pools failed outside its forward", len(batch), exc_info=e)
            for scheduler in batch:
                scheduler.fail_step(e)
        finally:
            with self._cond:
                self._running = set()
                self._cond.notify_all()

    def _shared_step(self, batch: list[BatchScheduler]) -> None:
        """One forward for the parts of every scheduler in ``batch`` (each run alone if it fails)."""
        decoding = any(s.running_rows for s in batch)
        admitting = sum(s.has_admission_work for s in batch)
        parts: list[SharedPart] = []
        for scheduler in batch:
            part = scheduler.shared_part(decoding, admitting)
            if part is not None:
                parts.append(part)
        if len(parts) <= 1:
            for part in parts:  # alone after all: its own step (a compiled one where it has one)
                part.scheduler.run_step()
            return
        try:
            with torch.profiler.record_function(SHARED_STEP_LABEL):
                packed, ids, positions = pack_parts([p for part in parts for p in part.parts])
                keep = packed.kept_positions()
                logits = parts[0].scheduler.packed_logits(ids, positions, packed, keep)  # [rows, vocab]
        except Exception:  # which group failed is unknown: each runs its step alone, nothing was advanced
            logger.warning("a step shared by %d pools failed; each runs its step alone", len(parts), exc_info=True)
            for part in parts:
                part.scheduler.run_step()
            return
        self.shared_steps += 1
        self.peak_pools_per_step = max(self.peak_pools_per_step, len(parts))
        offset = 0
        for part in parts:
            part.scheduler.finish_shared_part(part, logits[offset : offset + part.rows])
            offset += part.rows
