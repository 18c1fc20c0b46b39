"""A :class:`SchedulerTable`: the live batch schedulers of one engine, one per (model, pool, residency).

Every call over the same pool on the same model must reach the same scheduler to be batched with the
others; the table finds (or starts) it. The schedulers of one model share their steps (one
:class:`~polykv_agents.runtime.model_steps.ModelSteps` per model): calls over different pools go through the
model in one forward too. A scheduler idle for ``idle_seconds`` retires and leaves the
table; the next call starts a fresh one.

Lock order: the table's lock, then a scheduler's own condition (submit and retirement both follow it),
so a scheduler cannot retire between being looked up and receiving a request.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable, Iterator

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.model.heap import release_free_heap
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.block_store import BlockStore
from polykv_agents.runtime.call_limit import DEFAULT_MAX_CALLS, DEFAULT_WAIT_SECONDS, CallLimit
from polykv_agents.runtime.model_steps import ModelSteps
from polykv_agents.runtime.prefix_tree import PrefixTrees
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler import SCHEDULER_IDLE_SECONDS, BatchScheduler
from polykv_agents.runtime.shared_prefix import Residency
from polykv_agents.sampling.settings import token_constraint

logger = logging.getLogger(__name__)

DEFAULT_PREFIX_BYTES = 256 * 1024**2
"""Default budget for the keys and values finished calls leave for reuse: about 5,700 tokens of SmolLM2-135M in
fp32 (46 KB a token), twice that in bf16."""

# Every table alive, so that interpreter exit can stop their worker threads.
_TABLES: weakref.WeakSet[SchedulerTable] = weakref.WeakSet()


class SchedulerTable:
    """Batch schedulers by (model, pool digest, residency), started on first use, retired when idle.

    Args:
        idle_seconds: Seconds a scheduler waits without work before it retires; ``None``: never.
        compile_decode: Whether its schedulers compile their decode steps.
        max_prefix_bytes: Budget of the reusable prefixes that finished calls leave (:attr:`prefixes`); ``0``: no
            reuse. They outlive a retired scheduler: a follow-up turn an hour later still finds its conversation.
        max_block_bytes: Budget of the blocks finished calls leave for ``reuse="blocks"`` calls (:attr:`blocks`);
            ``0`` (the default): none kept, and such calls are refused.
        max_calls: Calls served at once over all pools, decoding or waiting for a row (``None``: no limit); a call
            beyond it waits up to ``call_wait_seconds`` for one to end, then is refused
            (:class:`~polykv_agents.runtime.call_limit.EngineBusyError`).
        call_wait_seconds: How long such a call waits.
        on_started: Called (outside the table's lock) after a scheduler starts, holding a new decoded prefix: the
            engine checks its byte budget then (:meth:`~polykv_agents.pool.registry.PoolRegistry.enforce_budget`).
    """

    def __init__(
        self,
        idle_seconds: float | None = SCHEDULER_IDLE_SECONDS,
        *,
        compile_decode: bool | str | Callable = False,
        max_prefix_bytes: int = DEFAULT_PREFIX_BYTES,
        max_block_bytes: int = 0,
        max_calls: int | None = DEFAULT_MAX_CALLS,
        call_wait_seconds: float = DEFAULT_WAIT_SECONDS,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        self.idle_seconds = idle_seconds
        self._on_started = on_started
        self.calls = CallLimit(max_calls, call_wait_seconds)
        """The engine's limit on calls at once (backpressure)."""
        self.compile_decode = compile_decode
        self.prefixes = PrefixTrees(max_prefix_bytes)
        """What finished calls ran through the model, per (model, pool), for later calls to reuse."""
        self.blocks = BlockStore(max_block_bytes)
        """The same, for calls that read it at other positions (``reuse="blocks"``)."""
        self._lock = threading.Lock()
        # model -> {(pool digest, residency): scheduler}; a model that is gone takes its schedulers with it.
        self._schedulers: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[str, str], BatchScheduler]] = (
            weakref.WeakKeyDictionary()
        )
        # model -> the steps its schedulers share (one forward for all of its pools)
        self._steps: weakref.WeakKeyDictionary[PreTrainedModel, ModelSteps] = weakref.WeakKeyDictionary()
        self._started = 0  # schedulers started so far
        _TABLES.add(self)

    def __len__(self) -> int:
        """Schedulers alive (each a worker thread and, when decompressed, a decoded prefix)."""
        with self._lock:
            return sum(len(per_model) for per_model in self._schedulers.values())

    def __repr__(self) -> str:
        return f"SchedulerTable(live={len(self)}, idle_seconds={self.idle_seconds})"

    def live(self) -> list[BatchScheduler]:
        """The schedulers alive now (benchmarks and tests read their counters)."""
        with self._lock:
            return [s for per_model in self._schedulers.values() for s in per_model.values()]

    def require_compiled(self) -> None:
        """Check that every live scheduler decodes through compiled steps: benchmarks of ``compile_decode`` call
        it after measuring (with ``idle_seconds=None``, so that no scheduler has retired in between).

        Raises:
            RuntimeError: No scheduler is live, one runs eager by design (``compile_decode`` off, or a compressed
                prefix), or one fell back to eager or compiled nothing (:meth:`.CompiledDecoder.require_compiled`).
        """
        schedulers = self.live()
        if not schedulers:
            msg = "no scheduler is live: nothing decoded that could be checked"
            raise RuntimeError(msg)
        for scheduler in schedulers:
            if scheduler.compiled is None:
                msg = "a scheduler decodes eager by design (compile_decode is off, or its prefix is kept compressed)"
                raise RuntimeError(msg)
            scheduler.compiled.require_compiled()

    def decoded_nbytes(self, digest: str) -> int:
        """Bytes of the decoded prefixes the live schedulers of pool ``digest`` hold (0 when kept compressed)."""
        with self._lock:
            return sum(s.prefix.resident_nbytes for key, s in self._keyed() if key[0] == digest)

    def release(self, digest: str) -> bool:
        """Retire every scheduler of pool ``digest`` now, if each is idle, freeing its decoded prefix; whether none
        is left (``False``: a call over the pool is running or waiting; those found idle before it may be gone)."""
        with self._lock:
            held = [(per_model, key, s) for per_model in self._schedulers.values() for key, s in per_model.items()
                    if key[0] == digest]  # fmt: skip
            if any(s.busy for _, _, s in held):
                return False
            for per_model, key, scheduler in held:
                if not scheduler.close_if_idle():  # work arrived since: it stays, and so does the pool
                    return False
                del per_model[key]
        return True

    def _keyed(self) -> list[tuple[tuple[str, str], BatchScheduler]]:
        """Every live scheduler with its (pool digest, residency); hold the lock."""
        return [item for per_model in self._schedulers.values() for item in per_model.items()]

    def steps_for(self, model: PreTrainedModel) -> ModelSteps:
        """The steps ``model``'s schedulers share (tests and benchmarks read its counters)."""
        with self._lock:
            return self._model_steps(model)

    def _model_steps(self, model: PreTrainedModel) -> ModelSteps:
        """``model``'s shared steps, made on first use (under the table's lock)."""
        return self._steps.setdefault(model, ModelSteps())

    def scheduler_for(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pool: SharedKVPool, residency: Residency
    ) -> BatchScheduler:
        """The one scheduler that batches every request over ``pool`` on ``model`` (until it retires)."""
        with self._lock:
            started = self._started
            scheduler = self._registered(model, tokenizer, pool, residency)
        self._announce(started)
        return scheduler

    def submit(self, request: DecodeRequest, residency: Residency, budget: int) -> Iterator[int]:
        """Queue ``request`` on its pool's scheduler; returns its token ids."""
        assert request.pool is not None, "a batched request reads a pool"
        # Outside the lock: compiling a grammar can take a while, and a bad grammar fails here.
        constraint = token_constraint(request.model, request.tokenizer, request.settings)
        self.calls.admit()  # may wait for a place, or refuse the call: before it holds anything
        try:
            with self._lock:
                started = self._started
                scheduler = self._registered(request.model, request.tokenizer, request.pool, residency)
                tokens = scheduler.submit(request, budget, constraint)
        except BaseException:
            self.calls.release()
            raise
        self._announce(started)
        return self.calls.holding(tokens)

    def _announce(self, started_before: int) -> None:
        """Tell ``on_started`` if a scheduler started since ``started_before`` (outside the lock: it may retire
        other pools' schedulers, which takes the lock)."""
        if self._on_started is not None and self._started != started_before:
            self._on_started()

    def close(self) -> None:
        """Stop every scheduler's worker thread (requests still queued are ended)."""
        with self._lock:
            schedulers = [s for per_model in self._schedulers.values() for s in per_model.values()]
            self._schedulers.clear()
        for scheduler in schedulers:
            scheduler.close()

    def _registered(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pool: SharedKVPool, residency: Residency
    ) -> BatchScheduler:
        """The live scheduler for ``(model, pool, residency)``, started if there is none; hold the lock."""
        key = (pool.digest, residency)
        per_model = self._schedulers.setdefault(model, {})
        if key not in per_model:

            def on_idle(scheduler: BatchScheduler) -> bool:
                return self._retire(model, key, scheduler)

            self._started += 1
            per_model[key] = BatchScheduler(
                model,
                tokenizer,
                pool,
                residency=residency,
                on_idle=on_idle,
                idle_seconds=self.idle_seconds,
                compile_decode=self.compile_decode,
                prefixes=self.prefixes if self.prefixes.max_bytes > 0 else None,
                blocks=self.blocks if self.blocks.max_bytes > 0 else None,
                steps=self._model_steps(model),
            )
        return per_model[key]

    def _retire(self, model: PreTrainedModel, key: tuple[str, str], scheduler: BatchScheduler) -> bool:
        with self._lock:
            if not scheduler.close_if_idle():
                return False
            per_model = self._schedulers.get(model, {})
            if per_model.get(key) is scheduler:
                del per_model[key]
        logger.debug("scheduler for pool %s retired after %.0f s idle", key[0][:12], scheduler.idle_seconds or 0)
        release_free_heap()  # the burst of calls it served is over: its scratch need not stay in the RSS
        return True


@atexit.register
def _close_all_tables() -> None:
    """Stop every worker thread at interpreter exit, where a thread still inside torch would abort the
    process instead of letting it exit cleanly."""
    for table in list(_TABLES):
        table.close()
