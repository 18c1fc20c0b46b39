"""NodeWorker: the Ray actor that holds one model replica on one node and runs that node's agent calls.

Data flow of one call (``invoke``):
  (chat settings, messages, call kwargs, pool handle, document) from the driver
  -> the pool, on this node: the process registry (with its byte budget); else fetched ONCE from the object
     store through the pool directory (one transfer per node, however many agents call at once: one lock per
     digest); else, when the directory has no such pool or its object is lost, loaded from the handle's
     store or rebuilt from the document, and published again
  -> ``ChatPolyKV(**settings).with_pool(pool).invoke(messages, **kwargs)`` on this node's model: concurrent
     calls (the actor runs them on threads) join the pool's batched scheduler, as in one process
  -> the AIMessage back to the driver.

``build`` finds a document's pool (here, or anywhere in the cluster through the directory) before prefilling
it, and publishes what it builds. ``stats`` reports what this node fetched, built and holds, measured here.
Bookkeeping methods (``stored_pool``, ``stats``, ``load``, ``release``) run in a concurrency group of their
own, so they never wait behind decoding calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import ray
from langchain_core.messages import AIMessage, BaseMessage

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.config import CompressionConfig
from polykv_agents.distributed.directory import pool_directory
from polykv_agents.distributed.object_store import from_stored, stored_nbytes, to_stored
from polykv_agents.engine import default_engine
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.record import PoolFileError
from polykv_agents.pool.registry import PoolNotFoundError
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.pool.store import PoolStore

logger = logging.getLogger(__name__)

CONTROL_GROUP = "control"
"""The concurrency group of the bookkeeping methods (its threads are apart from the decoding calls')."""

_DIRECTORY_ATTEMPTS = 5
"""Times a worker asks the pool directory before giving up (a dead one is replaced within a second)."""

# What fetching a published pool raises when it is gone: its owner (the directory) died, its only copy was
# lost with a node, or the object holds the error of a worker that could no longer produce it.
_POOL_LOST = (ray.exceptions.ObjectLostError, ray.exceptions.RayTaskError, PoolFileError)

Document = Sequence[dict[str, str]] | str


class NodeWorker:
    """One model replica and this node's view of the cluster's pools (run as a Ray actor).

    Args:
        model: The model of every call here (``ChatPolyKV.model``): loaded once, on first use.
        device: Where it runs.
        namespace: The Ray namespace of the cluster's pool directory.
    """

    def __init__(self, model: str, device: str, namespace: str | None) -> None:
        self._model_name = model
        self._device = device
        self._namespace = namespace
        self._engine = default_engine()  # this worker process's engine: its chat models use it too
        self._lock = threading.Lock()
        self._digest_locks: dict[str, threading.Lock] = {}
        self.fetches: Counter[str] = Counter()
        self.fetched_nbytes: Counter[str] = Counter()
        self.builds: Counter[str] = Counter()
        self.calls = 0

    def _model(self):
        return self._engine.load_model(self._model_name, device=self._device)

    def _digest_lock(self, digest: str) -> threading.Lock:
        with self._lock:
            return self._digest_locks.setdefault(digest, threading.Lock())

    def _ask_directory(self, call: Callable[[Any], Any]) -> Any:
        """``ray.get(call(directory))``; a directory that has just died may still answer to its name for a
        moment, so it is asked again."""
        for attempt in range(_DIRECTORY_ATTEMPTS):
            try:
                return ray.get(call(pool_directory(self._namespace)))
            except ray.exceptions.RayActorError:
                if attempt + 1 == _DIRECTORY_ATTEMPTS:
                    raise
                time.sleep(0.5)
        raise AssertionError  # unreachable

    # ---------------------------------------------------------------- pools

    @ray.method(concurrency_group=CONTROL_GROUP)
    def load(self) -> float:
        """Load this node's model replica now (else the first call does); returns the seconds it took."""
        started = time.perf_counter()
        self._model()
        return time.perf_counter() - started

    def build(self, document: Document, config: dict[str, Any], store_dir: str | None) -> PoolHandle:
        """The handle of ``document``'s pool: found here or in the cluster, else built here (or loaded from the
        store) and published."""
        model, tokenizer = self._model()
        config = CompressionConfig.model_validate(config)
        digest = self._engine.pools.digest_of(model, tokenizer, document, config)
        with self._digest_lock(digest):
            pool, built = self._engine.pools.get(digest) or self._fetch(digest), False
            made_here = pool is None  # the cluster has no copy that can be read: a lost one is replaced
            if made_here:
                store = PoolStore(store_dir) if store_dir else None
                builds_before = self._engine.pools.builds_by_digest.get(digest, 0)
                pool = self._engine.pools.get_or_build(model, tokenizer, document, config=config, store=store)
                built = self._count_build(digest, builds_before)
            object_id = self._publish(pool, built=built, replace=made_here)
        return PoolHandle.from_pool(pool, store_dir=store_dir, object_id=object_id)

    def _count_build(self, digest: str, builds_before: int) -> bool:
        """Whether this call prefilled pool ``digest`` (exact: the digest's lock is held, so no other call of this
        process builds it meanwhile), counted if so."""
        built = self._engine.pools.builds_by_digest.get(digest, 0) > builds_before
        self.builds[digest] += built
        return built

    def _publish(self, pool: SharedKVPool, *, built: bool, replace: bool) -> str:
        """Have the directory file ``pool`` (``replace``: even if it has it, its object being lost); the directory
        then asks this worker for the pool, and so owns it: it outlives this process. Returns the object id."""
        this_worker = ray.get_runtime_context().current_actor
        return self._ask_directory(
            lambda directory: directory.publish_from.remote(pool.digest, this_worker, built, replace)
        )

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stored_pool(self, digest: str) -> dict[str, Any]:
        """What the object store keeps of pool ``digest`` (the directory asks for it, and so owns the result)."""
        pool = self._engine.pools.get(digest)
        if pool is None:
            msg = f"pool {digest[:12]} is no longer held on this node (the registry's budget evicted it)"
            raise KeyError(msg)
        return to_stored(pool)

    def _fetch(self, digest: str) -> SharedKVPool | None:
        """The pool from the object store (counted as this node's fetch), or ``None`` if the cluster has none."""
        try:
            found = self._ask_directory(lambda directory: directory.lookup.remote(digest))
            if found is None:
                return None
            stored = ray.get(found[0])
            pool = from_stored(stored, digest=digest)
        except (*_POOL_LOST, ray.exceptions.RayActorError) as e:
            logger.warning("pool %s is lost from the object store (%s: %s)", digest[:12], type(e).__name__, e)
            return None
        self.fetches[digest] += 1
        self.fetched_nbytes[digest] += stored_nbytes(stored)
        self._engine.pools.put(pool)
        return pool

    def _pool(self, handle: PoolHandle, document: Document | None) -> SharedKVPool:
        """This node's pool for ``handle``: fetched once per node, however many calls arrive together."""
        with self._digest_lock(handle.digest):  # the other calls for this digest wait for the one fetch
            pool = self._engine.pools.get(handle.digest) or self._fetch(handle.digest)
            return pool if pool is not None else self._recover(handle, document)

    def _recover(self, handle: PoolHandle, document: Document | None) -> SharedKVPool:
        """The pool from the handle's store, else rebuilt from its document; published again either way."""
        model, tokenizer = self._model()
        builds_before = self._engine.pools.builds_by_digest.get(handle.digest, 0)
        try:
            pool = self._engine.pools.resolve(handle, model, tokenizer, document=document)
        except PoolNotFoundError as e:
            msg = (
                f"pool {handle.digest[:12]} is neither in the cluster's object store nor in a store, and the call "
                "has no document to rebuild it from; run the prefetch step again"
            )
            raise PoolNotFoundError(msg) from e
        self._publish(pool, built=self._count_build(handle.digest, builds_before), replace=True)
        return pool

    @ray.method(concurrency_group=CONTROL_GROUP)
    def release(self, digest: str) -> None:
        """Forget this node's copy of pool ``digest`` (once no call is using it)."""
        if digest in self._engine.pools and self._engine.pools.leases(digest) == 0:
            self._engine.pools.discard(digest)

    # ---------------------------------------------------------------- calls

    def invoke(
        self,
        settings: dict[str, Any],
        messages: list[BaseMessage],
        kwargs: dict[str, Any],
        handle: PoolHandle | None,
        document: Document | None,
    ) -> AIMessage:
        """One chat call on this node's model, over this node's copy of the pool."""
        with self._lock:
            self.calls += 1
        chat = ChatPolyKV(**settings, engine=self._engine)
        if handle is not None:
            chat = chat.with_pool(self._pool(PoolHandle.model_validate(handle), document))
        return chat.invoke(messages, **kwargs)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stats(self) -> dict[str, Any]:
        """What this node fetched, built and holds, measured in this process."""
        memory = psutil.Process(os.getpid()).memory_full_info()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "rss_bytes": memory.rss,
            "uss_bytes": memory.uss,  # this process's own pages: without the node's shared object store
            "calls": self.calls,
            "fetches": dict(self.fetches),
            "fetched_nbytes": dict(self.fetched_nbytes),
            "builds": dict(self.builds),
            "registry_nbytes": self._engine.pools.nbytes,
        }
