"""How a call reads its pool: the :class:`Backend` protocol and the two backends.

- :class:`BatchedBackend`: concurrent calls over one pool join that pool's batch scheduler
  (:mod:`~polykv_agents.runtime.scheduler`) and read ONE shared prefix through cascade attention; the
  prefix is kept decoded (``decompressed``) or only as the pool (``compressed``), or whichever is faster for the
  model on this machine (``auto``, the default: :mod:`~polykv_agents.runtime.residency`).
- :class:`PrivateBackend`: each call decodes the whole pool into a cache of its own (the reference design,
  a baseline for benchmarks; also what calls without a pool use).

Users pick one by name (:data:`Runtime`, a field of ``ChatPolyKV`` and ``PooledAgent``); an
:class:`~polykv_agents.engine.Engine` turns the name into a backend.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Literal, Protocol, get_args

from polykv_agents.model.architecture import unsupported_batched_attention
from polykv_agents.runtime.private import private_tokens
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.residency import auto_residency
from polykv_agents.runtime.scheduler_table import SchedulerTable
from polykv_agents.runtime.shared_prefix import Residency

logger = logging.getLogger(__name__)

Runtime = Literal["auto", "decompressed", "compressed", "private"]
"""A backend by name: ``decompressed`` / ``compressed`` are the batched backend with the prefix kept
decoded or compressed, ``auto`` the batched backend with the faster of the two for the call's model and pool;
``private`` is one decoded copy of the pool per call."""

RUNTIMES: tuple[str, ...] = get_args(Runtime)


class Backend(Protocol):
    """Decodes one request. Closing the returned iterator cancels the call and frees its cache at once."""

    name: str

    def decode(self, request: DecodeRequest, budget: int) -> Iterator[int]:
        """Token ids of ``request`` (EOS excluded), at most ``budget``; sets ``request.stats.finish_reason``."""
        ...


class PrivateBackend:
    """Every call alone, over a cache of its own."""

    name = "private"

    def decode(self, request: DecodeRequest, budget: int) -> Iterator[int]:
        return private_tokens(request, budget)


class BatchedBackend:
    """Calls over one pool batched into one forward pass per step, over one shared prefix.

    Args:
        schedulers: The table of live schedulers (an engine's).
        residency: Whether the shared prefix is kept ``decompressed`` or ``compressed``, or ``auto``: per call,
            :func:`~polykv_agents.runtime.residency.auto_residency` for its model and pool.
    """

    def __init__(self, schedulers: SchedulerTable, residency: Residency | Literal["auto"]) -> None:
        self.schedulers = schedulers
        self.residency = residency
        self.name = residency
        # model -> why cascade attention cannot serve it (None: it can); asked once per model.
        self._verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._verdicts_lock = threading.Lock()

    def decode(self, request: DecodeRequest, budget: int) -> Iterator[int]:
        if request.pool is None:  # nothing to share: the call decodes alone
            return private_tokens(request, budget)
        if self._unsupported(request.model) is not None:  # never served wrongly: the model's own attention
            return private_tokens(request, budget)
        return self.schedulers.submit(request, self._residency(request), budget)

    def _residency(self, request: DecodeRequest) -> Residency:
        if self.residency != "auto":
            return self.residency
        compiled = self.schedulers.compile_decode is not False
        return auto_residency(request.model, request.pool, compiled_steps=compiled)

    def _unsupported(self, model) -> str | None:
        with self._verdicts_lock:
            if model in self._verdicts:
                return self._verdicts[model]
            reason = self._verdicts[model] = unsupported_batched_attention(model)
        if reason is not None:
            logger.warning("%s; its calls run on the private runtime (one decoded pool per call)", reason)
        return reason


def check_runtime(runtime: object) -> Runtime:
    """``runtime`` checked against :data:`RUNTIMES`."""
    if runtime not in RUNTIMES:
        msg = f"runtime must be one of {', '.join(map(repr, RUNTIMES))}, got {runtime!r}"
        raise ValueError(msg)
    return runtime  # type: ignore[return-value]
