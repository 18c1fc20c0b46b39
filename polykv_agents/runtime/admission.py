"""Admission: how waiting requests become decoding rows of a :class:`~polykv_agents.runtime.scheduler.BatchScheduler`.

  take_waiting          the waiting requests that fit in the free rows (cancelled ones and empty budgets end here)
  Admission.prepare     their prompts after each one's stored start (:mod:`~polykv_agents.runtime.reuse`),
                        left-padded to the longest part still to prefill: ``ids [A, width]``, so every row's last
                        prompt token lands in the last column; their rows of a new suffix cache, the stored
                        starts loaded
  Admission.chunk       the next prompt columns ``[A, c]`` the scheduler runs through the model over ``rows``: all
                        of them at once when nobody else decodes, else about ``admission_chunk_tokens`` prompt
                        tokens per step (alone, or packed with the running rows' step: ``runtime/packed_step.py``)
  Admission.finish      after the last chunk: each request samples its first token from its ``logits [A, vocab]``;
                        those still going keep their rows, which the scheduler appends to the running batch

The scheduler owns the forwards and the running rows; an admission owns which columns go next and who joins.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polykv_agents.runtime.block_reuse import ComposedStart
from polykv_agents.runtime.prefix_tree import PrefixMatch
from polykv_agents.runtime.scheduled_request import ScheduledRequest
from polykv_agents.runtime.suffix_cache import SuffixCache

ADMISSION_CHUNK_TOKENS = 128
"""Prompt tokens (over all rows being admitted) prefilled per step while other rows decode, by default."""


def take_waiting(inbox: queue.SimpleQueue[ScheduledRequest], free_rows: int) -> list[ScheduledRequest]:
    """Up to ``free_rows`` requests from ``inbox`` to admit now; one already cancelled, or with no token to make,
    ends here without a row."""
    admitted: list[ScheduledRequest] = []
    while len(admitted) < free_rows:
        try:
            request = inbox.get_nowait()
        except queue.Empty:
            break
        if request.cancelled.is_set():
            request.finish("stop")
        elif request.budget == 0:
            request.finish("length")
        else:
            request.stats.started_at = time.monotonic()
            admitted.append(request)
    return admitted


@dataclass(eq=False)
class Admission:
    """Requests being admitted together: their left-padded prompts and the suffix rows prefilled so far."""

    requests: list[ScheduledRequest]
    ids: torch.Tensor  # [A, width] prompts after their stored starts, left-padded to the longest
    rows: SuffixCache  # their suffixes: the stored starts, then the first ``done`` columns of ids
    done: int = 0

    @classmethod
    def prepare(
        cls,
        requests: list[ScheduledRequest],
        starts: list[PrefixMatch | ComposedStart],
        num_layers: int,
    ) -> Admission:
        """``requests`` with their stored ``starts``, left-padded so each row's last prompt token is the last
        column (the padding slots are masked for good); each request's stats say what it reused."""
        # Every row's last prompt token must land in the last column. The width is the longest part still to
        # prefill; a row with less to prefill reads fewer stored tokens and prefills more of its own instead of
        # padding: the same columns are computed either way.
        width = max(r.prompt_ids.numel() - m.length for r, m in zip(requests, starts, strict=True))
        reused = [max(0, min(m.length, r.prompt_ids.numel() - width)) for r, m in zip(requests, starts, strict=True)]
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        rows = SuffixCache(num_layers, len(requests), capacity=max(reused) + width)
        for row, (request, match, stored) in enumerate(zip(requests, starts, reused, strict=True)):
            n = request.prompt_ids.numel()
            pad = max(0, width - n)
            ids[row, pad:] = request.prompt_ids[stored:]  # [n - stored] = [width - pad]
            rows.starts[row] = pad
            if stored:
                rows.load_row(row, [match.layer(i, stored) for i in range(num_layers)])
            request.stats.reused_tokens = stored
            request.stats.evicted_tokens = min(match.evicted_tokens, n - 1 - stored)
            if isinstance(match, ComposedStart):  # part of its start was computed in composing: not reused
                request.stats.reused_tokens = match.reused_before(stored)
                request.stats.block_tokens = match.moved_before(stored)
                # Never stored as exact past its first moved block, even all recomputed: the tree holds prefills only.
                request.exact_length = match.exact_length if match.exact_length < stored else None
        return cls(requests, ids, rows)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def complete(self) -> bool:
        """Whether every prompt column has gone through the model."""
        return self.done == self.width

    def next_columns(self, others_decoding: bool, chunk_tokens: int | None) -> int:
        """Prompt columns to prefill this step: all that are left when no other row is decoding (nobody waits),
        else about ``chunk_tokens`` prompt tokens over all rows (``None``: all that are left)."""
        columns = self.width - self.done
        if others_decoding and chunk_tokens is not None:
            columns = min(columns, max(1, chunk_tokens // len(self.requests)))
        return columns

    def chunk(self, columns: int) -> torch.Tensor:
        """The next ``columns`` prompt columns ``[A, columns]``."""
        return self.ids[:, self.done : self.done + columns]

    def fail(self, error: BaseException) -> None:
        """End every request being admitted with ``error`` (raised to its consumer)."""
        for request in self.requests:
            request.fail(error)

    def finish(
        self,
        logits: torch.Tensor,
        emit: Callable[[ScheduledRequest, torch.Tensor], None],
        remember: Callable[[ScheduledRequest, SuffixCache, int], None],
    ) -> list[ScheduledRequest]:
        """The last chunk is in (``logits [A, vocab]`` at each row's last prompt token): each request gets its
        first token (``emit``); returns those still going, whose rows alone are then left in :attr:`rows`. A row
        that ends here is stored for reuse (``remember``) before it goes."""
        keep: list[int] = []
        for row, request in enumerate(self.requests):
            if request.cancelled.is_set():  # its consumer left while its prompt was being prefilled
                request.finish("stop")
                remember(request, self.rows, row)
                continue
            emit(request, logits[row])
            if request.stats.finish_reason is None:
                keep.append(row)
            else:
                remember(request, self.rows, row)
        if keep:
            self.rows.select(torch.tensor(keep, dtype=torch.long))
        return [self.requests[row] for row in keep]
