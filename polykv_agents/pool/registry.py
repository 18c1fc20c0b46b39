"""PoolRegistry: the pools of this process by digest, each prefilled at most once.

LangGraph state holds a :class:`~polykv_agents.pool.handle.PoolHandle`, never tensors; the pool itself
lives here. Data flow of :meth:`PoolRegistry.get_or_build`:
  document -> token ids and model fingerprint -> digest (no prefill needed to know it)
  -> already registered? return it
  -> else saved in the store? load it (:class:`~polykv_agents.pool.store.PoolStore`)
  -> else prefill it, save it to the store if one is given
  -> register it and return it.
:meth:`PoolRegistry.resolve` does the same from a handle, for a node that may run in a fresh process
(a checkpointed thread resumed elsewhere): registry, then the handle's store, then a rebuild from the
document, which is deterministic, so it reproduces the digest the handle names.

Memory budget: the registry holds at most ``max_bytes`` of pools (``SharedKVPool.nbytes``, measured
from the stored tensors) and evicts the least recently used ones beyond it. In an engine the budget also counts
what the engine holds at run time for each registered pool, its decoded prefixes (``run_time``, the engine's
scheduler table): evicting a pool retires its idle schedulers, which frees them; a pool with a call running or
waiting is in use, as under a lease. A pool that is in use is
never evicted: chat-model calls hold a lease on their pool (:meth:`PoolRegistry.use`) for as long as
they generate, and the most recently registered pool stays even when it alone exceeds the budget.
When every pool is in use the registry stays over budget (and logs it) until a lease ends. An evicted
pool is forgotten, or, with a ``spill`` store, first written there (once: files are content-addressed): a later
:meth:`resolve` or :meth:`get_or_build` of its digest loads it back from the spill store instead of prefilling
the document again, and a handle that names no store of its own still finds it. Without a spill store a
later call loads it from its handle's store or rebuilds it.

Thread safety: one lock guards the dictionaries and is never held while loading or prefilling, so
builds of different documents run concurrently. Concurrent requests for the same digest share one
build: the first caller builds, the others wait on its future.

Each :class:`~polykv_agents.engine.Engine` holds one registry (``engine.pools``); the default engine's
budget is :data:`DEFAULT_MAX_BYTES` unless the environment variable ``POLYKV_POOL_BUDGET_BYTES`` sets another.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.config import CompressionConfig, compression_config
from polykv_agents.model.architecture import check_causal_lm
from polykv_agents.model.fingerprint import check_same_model, model_fingerprint
from polykv_agents.pool.documents import Document, tokenize_document
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.prefill import DEFAULT_CHUNK_SIZE
from polykv_agents.pool.shared_pool import SharedKVPool, pool_digest
from polykv_agents.pool.store import PoolStore

logger = logging.getLogger(__name__)

PoolOrigin = Literal["built", "store", "spill", "given"]
"""How a pool came into a registry: prefilled there, loaded from a store or from the registry's spill store, or
registered as an object."""

DEFAULT_MAX_BYTES = 2 * 1024**3
"""Budget of the default engine's registry: 2 GiB of pools (about 65 SmolLM2-135M pools of 4K tokens)."""


class RunTimeHolder(Protocol):
    """What holds bytes for a pool at run time (an engine's
    :class:`~polykv_agents.runtime.scheduler_table.SchedulerTable`)."""

    def decoded_nbytes(self, digest: str) -> int:
        """Bytes held for pool ``digest`` besides the pool."""
        ...

    def release(self, digest: str) -> bool:
        """Free them if nothing uses the pool now; whether it did."""
        ...


class PoolNotFoundError(LookupError):
    """A handle's pool is in neither this process's registry nor its store, and there is no document to rebuild it."""


class PoolRegistry:
    """Pools by digest, built (or loaded) at most once each, shared by every thread of the process.

    An engine's ``pools`` (see :class:`~polykv_agents.engine.Engine`); separate engines are for tests, for
    simulating a fresh process and for servers that keep tenants apart. A registry keeps its pools until
    :meth:`discard`, :meth:`clear`, or eviction by the
    byte budget (see the module docstring).

    Args:
        max_bytes: Budget for the pools held (sum of ``SharedKVPool.nbytes``); ``None``: unbounded.
        spill: Where pools evicted by the budget go, to be loaded back by digest; ``None``: they are forgotten.
        run_time: What holds bytes for a pool besides the pool, counted in the budget and released with it (an
            engine's scheduler table); ``None``: the pools alone.
    """

    def __init__(
        self, max_bytes: int | None = None, spill: PoolStore | None = None, run_time: RunTimeHolder | None = None
    ) -> None:
        self.spill = spill
        """Where evicted pools are written (see the module docstring)."""
        self.run_time = run_time
        """What holds run-time bytes per pool (see the module docstring)."""
        self._spills = 0
        self._lock = threading.RLock()
        self._pools: OrderedDict[str, SharedKVPool] = OrderedDict()  # least recently used first
        self._leases: Counter[str] = Counter()
        self._in_flight: dict[str, Future[SharedKVPool]] = {}
        self._build_count = 0
        self._builds_by_digest: dict[str, int] = {}
        self._origins: dict[str, PoolOrigin] = {}
        self._evictions = 0
        self._max_bytes: int | None = None
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return (
            f"PoolRegistry(pools={len(self)}, nbytes={self.nbytes}, max_bytes={self.max_bytes}, "
            f"builds={self.build_count})"
        )

    # ---------------------------------------------------------------- the dictionary

    def get(self, digest: str) -> SharedKVPool | None:
        """The registered pool ``digest`` (now the most recently used), or ``None``."""
        with self._lock:
            pool = self._pools.get(digest)
            if pool is not None:
                self._pools.move_to_end(digest)
            return pool

    def put(self, pool: SharedKVPool) -> None:
        """Register ``pool`` under its digest (replacing a pool with the same digest, which holds the same data)."""
        if not isinstance(pool, SharedKVPool):
            msg = f"pool must be a SharedKVPool, got {type(pool).__name__}; build one with SharedKVPool.prefill(...)"
            raise TypeError(msg)
        with self._lock:
            self._origins[pool.digest] = "given"
            self._register(pool)

    def origin(self, digest: str) -> PoolOrigin | None:
        """How pool ``digest`` last came into this registry: ``built`` (prefilled here), ``store`` (loaded from a
        store), ``spill`` (loaded back from the spill store after an eviction) or ``given`` (registered as an
        object); ``None`` if it never did."""
        with self._lock:
            return self._origins.get(digest)

    def discard(self, digest: str) -> None:
        """Forget pool ``digest`` (freeing its memory once no agent holds it); nothing happens if it is unknown.

        Raises:
            RuntimeError: The pool is in use (a lease is open on it).
        """
        with self._lock:
            if self._leases[digest]:
                msg = f"pool {digest[:12]}... is in use by {self._leases[digest]} call(s); discard it after they end"
                raise RuntimeError(msg)
            self._pools.pop(digest, None)

    def clear(self) -> None:
        """Forget every pool that is not in use and reset the build counts. Builds still in flight
        register their pool when done."""
        with self._lock:
            for digest in [d for d in self._pools if not self._leases[d]]:
                del self._pools[digest]
            self._build_count = 0
            self._builds_by_digest.clear()

    def __contains__(self, digest: object) -> bool:
        with self._lock:
            return digest in self._pools

    def __len__(self) -> int:
        with self._lock:
            return len(self._pools)

    @property
    def nbytes(self) -> int:
        """Bytes of the pools held (``SharedKVPool.nbytes`` summed)."""
        with self._lock:
            return sum(pool.nbytes for pool in self._pools.values())

    @property
    def resident_nbytes(self) -> int:
        """What the budget counts: the pools' bytes and what ``run_time`` holds for them (decoded prefixes)."""
        with self._lock:
            return sum(self._held_nbytes().values())

    def enforce_budget(self) -> None:
        """Evict down to the budget now: an engine calls it when a scheduler has started, holding a decoded prefix
        the budget counts (pools registered or leased are checked as they come and go)."""
        with self._lock:
            self._evict_over_budget()

    @property
    def max_bytes(self) -> int | None:
        """The byte budget; setting it evicts down to the new budget at once."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            msg = f"max_bytes must be a non-negative number of bytes or None (no budget), got {value!r}"
            raise ValueError(msg)
        with self._lock:
            self._max_bytes = value
            self._evict_over_budget()

    @property
    def evictions(self) -> int:
        """Pools evicted by the byte budget so far."""
        with self._lock:
            return self._evictions

    @property
    def build_count(self) -> int:
        """Prefills this registry has performed (loads from a store are not builds)."""
        with self._lock:
            return self._build_count

    @property
    def builds_by_digest(self) -> dict[str, int]:
        """Prefills performed per pool digest (a copy)."""
        with self._lock:
            return dict(self._builds_by_digest)

    def leases(self, digest: str) -> int:
        """Calls currently using pool ``digest`` (see :meth:`use`)."""
        with self._lock:
            return self._leases[digest]

    @contextlib.contextmanager
    def leased(self, pool: SharedKVPool) -> Iterator[SharedKVPool]:
        """Hold ``pool`` in the registry, safe from eviction, for the ``with`` block (re-registering it if it
        was evicted meanwhile: the caller holds it anyway, so forgetting it would only invite a rebuild)."""
        with self._lock:
            self._leases[pool.digest] += 1
            self._register(pool)
        try:
            yield pool
        finally:
            with self._lock:
                self._leases[pool.digest] -= 1
                if not self._leases[pool.digest]:
                    del self._leases[pool.digest]
                if pool.digest in self._pools:  # it was just used: the most recently used, not the next to go
                    self._pools.move_to_end(pool.digest)
                self._evict_over_budget()

    @contextlib.contextmanager
    def use(
        self,
        handle: PoolHandle | Mapping[str, Any],
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        document: Document | None = None,
    ) -> Iterator[SharedKVPool]:
        """:meth:`resolve` ``handle`` and hold the pool safe from eviction for the ``with`` block."""
        with self.leased(self.resolve(handle, model, tokenizer, document=document)) as pool:
            yield pool

    def _register(self, pool: SharedKVPool) -> None:
        """Add or refresh ``pool`` as the most recently used, then evict down to the budget. Hold the lock."""
        self._pools[pool.digest] = pool
        self._pools.move_to_end(pool.digest)
        self._evict_over_budget()

    def _evict_over_budget(self) -> None:
        """Evict least recently used pools that are not in use until the budget holds; never the most
        recently used one. Hold the lock."""
        if self._max_bytes is None:
            return
        held = self._held_nbytes()
        total = sum(held.values())
        for digest in list(self._pools)[:-1]:  # least recently used first; the newest one stays
            if total <= self._max_bytes:
                return
            if self._leases[digest]:
                continue
            if self.run_time is not None and not self.run_time.release(digest):
                continue  # a call over it is running or waiting: in use
            pool = self._pools.pop(digest)
            total -= held[digest]
            self._evictions += 1
            self._spill(pool)
            logger.info(
                "evicted pool %s... (least recently used) to stay within %d bytes", digest[:12], self._max_bytes
            )
        if total > self._max_bytes:
            logger.warning(
                "pool registry holds %d bytes, over its %d-byte budget: every other pool is in use",
                total,
                self._max_bytes,
            )

    def _held_nbytes(self) -> dict[str, int]:
        """What the budget counts per registered pool: its bytes and what ``run_time`` holds for it. Hold the lock."""
        extra = (lambda digest: 0) if self.run_time is None else self.run_time.decoded_nbytes
        return {digest: pool.nbytes + extra(digest) for digest, pool in self._pools.items()}

    def _spill(self, pool: SharedKVPool) -> None:
        """Write an evicted ``pool`` to the spill store, unless it is there already. Hold the lock: a call for
        its digest meanwhile must find it registered or spilled, never neither (a write of a pool takes
        milliseconds per MiB)."""
        if self.spill is None or pool.digest in self.spill:
            return
        try:
            self.spill.save(pool)
        except OSError as e:  # the pool is only forgotten, as without a spill store: a later call rebuilds it
            logger.warning("could not spill pool %s... to %s: %s", pool.digest[:12], self.spill.directory, e)
            return
        self._spills += 1

    @property
    def spills(self) -> int:
        """Evicted pools written to the spill store so far."""
        with self._lock:
            return self._spills

    # ---------------------------------------------------------------- building

    def get_or_build(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        document: Document,
        *,
        config: CompressionConfig | None = None,
        store: PoolStore | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> SharedKVPool:
        """The pool of ``document``: registered, else loaded from ``store``, else prefilled (and saved to ``store``).

        Args:
            model: A Hugging Face causal LM (see :func:`polykv_agents.load_model`).
            tokenizer: Its tokenizer.
            document: Plain text, or chat messages rendered with the chat template.
            config: Compression; ``None`` for the default.
            store: Where to look for a saved copy and to save a new build; ``None``: memory only.
            chunk_size: Tokens per forward pass during prefill.

        Raises:
            TypeError: ``model`` is not a causal LM.
            ValueError: Empty document, or longer than the model's positions.
            PoolFileError: The store's file for this pool is corrupted or of another format version
                (the message says to delete it or rebuild).
        """
        check_causal_lm(model)
        config = compression_config(config)
        tokenized = _TokenizedDocument.of(model, tokenizer, document, config)  # tokenized once, for digest and prefill
        digest = tokenized.digest

        def build() -> SharedKVPool:
            return self._prefill(tokenized, model, tokenizer, config=config, store=None, chunk_size=chunk_size)

        pool = self._load_or_build(digest, store, build)
        if store is not None and pool.digest not in store:  # just built, or registered earlier without this store
            _save(store, pool)
        return pool

    def resolve(
        self,
        handle: PoolHandle | Mapping[str, Any],
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        document: Document | None = None,
    ) -> SharedKVPool:
        """The pool ``handle`` names: registered, else loaded from ``handle.store_dir``, else rebuilt from ``document``.

        Args:
            handle: A :class:`PoolHandle`, or its fields as a dict (what a strict LangGraph checkpoint
                serializer returns).
            model: The model the pool was built with (checked against the handle's fingerprint).
            tokenizer: Its tokenizer.
            document: The document the pool was built from; only read when the pool must be rebuilt.

        Raises:
            ValueError: ``model`` is not the model the pool was built with, or ``document`` is not the
                document it was built from.
            PoolFileError: The saved file is corrupted or of another format version.
            PoolNotFoundError: The pool is nowhere to be found and no document was given.
        """
        handle = PoolHandle.model_validate(handle)
        check_causal_lm(model)
        # Before anything else: with another model, a rebuild would give another digest and a misleading
        # "wrong document" error.
        check_same_model(handle.fingerprint, model, tokenizer)
        pool = self.get(handle.digest)
        if pool is not None:
            return pool
        store = None if handle.store_dir is None else PoolStore(handle.store_dir)
        if document is None:
            return self._load_or_build(handle.digest, store, None)

        def build() -> SharedKVPool:
            tokenized = _TokenizedDocument.of(model, tokenizer, document, handle.config)
            digest = tokenized.digest
            if digest != handle.digest:
                msg = (
                    f"the document given to rebuild pool {handle.digest[:12]}... is not the one it was built from "
                    f"(it gives pool {digest[:12]}...); pass the document that was in the graph state when the "
                    "pool was built"
                )
                raise ValueError(msg)
            return self._prefill(tokenized, model, tokenizer, config=handle.config, store=store)

        return self._load_or_build(handle.digest, store, build)

    def digest_of(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        document: Document,
        config: CompressionConfig | None = None,
    ) -> str:
        """The digest the pool of ``document`` has (or would have), without building it: tokenizing is enough."""
        return _TokenizedDocument.of(model, tokenizer, document, compression_config(config)).digest

    # ---------------------------------------------------------------- internals

    def _load_or_build(
        self, digest: str, store: PoolStore | None, build: Callable[[], SharedKVPool] | None
    ) -> SharedKVPool:
        """Registry, then ``store``, then the spill store, then ``build`` (``None``: nothing to build from), at
        most once per digest."""

        def produce() -> SharedKVPool:
            for saved in (store, self.spill):
                if saved is None:
                    continue
                try:
                    pool = saved.load(digest)
                except FileNotFoundError:  # no saved copy here
                    continue
                with self._lock:
                    self._origins[digest] = "store" if saved is store else "spill"
                return pool
            if build is None:
                where = "no store was given" if store is None else f"no saved copy is in {store.directory}"
                msg = (
                    f"pool {digest[:12]}... is unknown in this process, {where}, and no document was given to "
                    "rebuild it; run the prefetch node (which builds the pool) first, or pass document= to resolve()"
                )
                raise PoolNotFoundError(msg)
            return build()

        return self._single_flight(digest, produce)

    def _single_flight(self, digest: str, produce: Callable[[], SharedKVPool]) -> SharedKVPool:
        """Run ``produce`` for ``digest`` in one thread at a time; callers arriving meanwhile wait for its result.

        When the running call fails, each waiter tries again with its own ``produce``: the failure may be
        the first caller's own (no document to rebuild from, the wrong document), not theirs.
        """
        while True:
            with self._lock:
                pool = self._pools.get(digest)
                if pool is not None:
                    return pool
                future = self._in_flight.get(digest)
                if future is None:
                    future = self._in_flight[digest] = Future()
                    break  # this caller produces
            wait([future])
            if future.exception() is None:
                return future.result()
        try:
            pool = produce()
        except BaseException as e:
            with self._lock:
                del self._in_flight[digest]
            future.set_exception(e)
            raise
        with self._lock:
            self._register(pool)
            del self._in_flight[digest]
        future.set_result(pool)
        return pool

    def _prefill(
        self,
        tokenized: _TokenizedDocument,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        config: CompressionConfig,
        store: PoolStore | None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> SharedKVPool:
        pool = SharedKVPool.prefill_tokens(
            model,
            tokenizer,
            tokenized.token_ids,
            prefix_messages=tokenized.messages,
            config=config,
            chunk_size=chunk_size,
        )
        with self._lock:
            self._build_count += 1
            self._builds_by_digest[pool.digest] = self._builds_by_digest.get(pool.digest, 0) + 1
            self._origins[pool.digest] = "built"
        if pool.digest != tokenized.digest:  # the model changed between computing the digest and the prefill
            logger.warning("model %s changed during the build; pool registered under its new digest", model)
        if store is not None:
            _save(store, pool)
        return pool


@dataclass(frozen=True)
class _TokenizedDocument:
    """A document's token ids ``[T]`` (and messages, for a chat prefix) with the digest its pool has."""

    token_ids: torch.Tensor
    messages: list[dict[str, str]] | None
    digest: str

    @classmethod
    def of(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        document: Document,
        config: CompressionConfig,
    ) -> _TokenizedDocument:
        token_ids, messages = tokenize_document(model, tokenizer, document)  # [T]
        fingerprint = model_fingerprint(model, tokenizer)
        return cls(token_ids, messages, pool_digest(fingerprint, config, token_ids, chat_prefix=messages is not None))


def _save(store: PoolStore, pool: SharedKVPool) -> None:
    try:
        store.save(pool)
    except OSError as e:
        # The pool is built and registered; only its saved copy is missing, and a resumed thread can
        # still rebuild it from the document.
        message = f"could not save pool {pool.digest[:12]}... to {store.directory}: {e}"
        warnings.warn(message, stacklevel=_first_frame_outside_this_module())


def _first_frame_outside_this_module() -> int:
    """The ``stacklevel`` (counted from the caller) of the nearest frame outside this module, so that a
    warning names the user's call whichever path (``get_or_build``, ``resolve``) reached it."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level
