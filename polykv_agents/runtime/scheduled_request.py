"""One call as a :class:`~polykv_agents.runtime.scheduler.BatchScheduler` tracks it, from submit to its last token.

  submit (any thread)    makes a :class:`ScheduledRequest` and queues it; the caller iterates :meth:`stream`
  the scheduler's worker puts each token id into ``out``, then an end (:meth:`finish`) or an error (:meth:`fail`)
  the consumer          reads ``out`` through :meth:`stream`; closing that iterator sets ``cancelled``, which the
                        worker reads at its next step boundary (the row is freed, the other rows go on)

Everything the worker knows about the call lives here: its sampling state (generator, grammar, repetition
history), how many tokens it made, and its tokens so far (the key under which its keys and values are stored for
later calls, :mod:`~polykv_agents.runtime.reuse`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from polykv_agents.sampling.grammar import TokenConstraint
from polykv_agents.sampling.settings import GenerationSettings, GenerationStats

_END = object()
"""Put into ``out`` after the last token: the consumer's iterator returns."""


@dataclass(eq=False)
class ScheduledRequest:
    """One call's row in the scheduler: waiting, being admitted, or decoding."""

    prompt_ids: torch.Tensor  # [n]
    settings: GenerationSettings
    budget: int
    stats: GenerationStats
    generator: torch.Generator | None
    constraint: TokenConstraint | None = None  # this request's own grammar state, if it has a grammar
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    produced: int = 0
    last_token: int = -1
    history: set[int] | None = None  # what a repetition penalty looks at (None: no penalty)
    tokens: list[int] = field(default_factory=list)  # its prompt, then what it generated: the prefix tree's key
    exact_length: int | None = None  # its row is exact for this many tokens only (blocks moved in after); None: all

    def finish(self, reason: str) -> None:
        self.stats.finish_reason = reason  # type: ignore[assignment]
        self.out.put(_END)

    def fail(self, error: BaseException) -> None:
        """End this request with ``error`` (raised to its consumer); the other rows go on."""
        self.stats.finish_reason = "stop"
        self.out.put(error)

    def stream(self) -> Iterator[int]:
        """The consumer's side: token ids as the worker delivers them; an error it delivered is raised here.
        Closing (or leaving) this iterator cancels the request."""
        try:
            while True:
                item = self.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled.set()
