"""NodeWorker: the Ray actor that holds one model replica on one node and runs that node's agent calls.

Data flow of one call (``invoke``):
  (chat settings, messages, call kwargs, pool handle, document) from the driver
  -> the pool, local to this node: the process registry; else fetched ONCE from the object store through
     the pool directory (one transfer per node, however many agents call); else, when the directory or
     the pool's owner is lost, loaded from the handle's store or rebuilt from the document, and published
     again
  -> ``ChatPolyKV(**settings).with_pool(pool).invoke(messages, **kwargs)`` on this node's model: concurrent
     calls (the actor runs them on threads) join the pool's batched scheduler, as in one process
  -> the AIMessage back to the driver.

``build`` prefills a document into a pool on this node and publishes it (owned by the directory, so the
pool outlives this worker). ``stats`` reports what the node fetched, built and holds, measured here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psutil
import ray
from langchain_core.messages import AIMessage, BaseMessage

from polykv_agents.chat_model import ChatPolyKV
from polykv_agents.config import CompressionConfig
from polykv_agents.distributed.directory import pool_directory
from polykv_agents.distributed.object_store import from_stored, stored_nbytes, to_stored
from polykv_agents.handle import PoolHandle
from polykv_agents.models import load_model
from polykv_agents.pool import SharedKVPool
from polykv_agents.registry import POOL_REGISTRY, PoolNotFoundError
from polykv_agents.store import PoolStore

logger = logging.getLogger(__name__)

_DIRECTORY_ATTEMPTS = 5
"""Times a worker asks for the pool directory before giving up (a dead one is replaced within a second)."""

# What ray.get raises when a published pool is gone: its owner (the directory) died, or its copies were lost.
_POOL_LOST = (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError, ray.exceptions.RayActorError)


class NodeWorker:
    """One model replica and this node's copy of each pool it was asked about (run as a Ray actor).

    Args:
        model: The model every call here uses (``ChatPolyKV.model``): loaded once, on the first call.
        device: Where it runs.
        namespace: The Ray namespace of the cluster's pool directory.
    """

    def __init__(self, model: str, device: str, namespace: str | None) -> None:
        self._model_name = model
        self._device = device
        self._namespace = namespace
        self._lock = threading.Lock()
        self._pool_locks: dict[str, threading.Lock] = {}
        self._pools: dict[str, SharedKVPool] = {}  # held here, so the registry's budget cannot evict them
        self.fetches: Counter[str] = Counter()
        self.fetched_nbytes: Counter[str] = Counter()
        self.builds: Counter[str] = Counter()
        self.calls = 0

    def _model(self):
        return load_model(self._model_name, device=self._device)

    def load(self) -> float:
        """Load this node's model replica now (else the first call does); returns the seconds it took."""
        started = time.perf_counter()
        self._model()
        return time.perf_counter() - started

    # ---------------------------------------------------------------- pools

    def build(
        self, document: Sequence[dict[str, str]] | str, config: dict[str, Any], store_dir: str | None
    ) -> PoolHandle:
        """Prefill ``document`` into a pool here (or find it built), publish it, return its handle."""
        model, tokenizer = self._model()
        store = PoolStore(store_dir) if store_dir else None
        builds_before = POOL_REGISTRY.builds_by_digest.copy()
        pool = POOL_REGISTRY.get_or_build(
            model, tokenizer, document, config=CompressionConfig.model_validate(config), store=store
        )
        built = POOL_REGISTRY.builds_by_digest[pool.digest] > builds_before.get(pool.digest, 0)
        if built:
            self.builds[pool.digest] += 1
        self._pools[pool.digest] = pool
        return PoolHandle.from_pool(pool, store_dir=store_dir, object_id=self._publish(pool, built=built))

    def _publish(self, pool: SharedKVPool, *, built: bool) -> str:
        """File ``pool`` in the cluster's directory, which becomes its owner (so it outlives this process).
        A directory that has just died may still answer to its name for a moment: ask again."""
        this_worker = ray.get_runtime_context().current_actor
        for attempt in range(_DIRECTORY_ATTEMPTS):
            try:
                return ray.get(pool_directory(self._namespace).publish_from.remote(pool.digest, this_worker, built))
            except ray.exceptions.RayActorError:
                if attempt + 1 == _DIRECTORY_ATTEMPTS:
                    raise
                time.sleep(0.5)
        raise AssertionError  # unreachable

    def stored_pool(self, digest: str) -> dict[str, Any]:
        """What the object store keeps of pool ``digest`` (the directory asks for it, and so owns the result)."""
        return to_stored(self._pools[digest])

    def _pool(self, handle: PoolHandle, document: Sequence[dict[str, str]] | str | None) -> SharedKVPool:
        """This node's pool for ``handle``: fetched once per node, however many calls arrive together."""
        with self._lock:
            if handle.digest in self._pools:
                return self._pools[handle.digest]
            lock = self._pool_locks.setdefault(handle.digest, threading.Lock())
        with lock:  # one fetch per digest; the other calls wait for it
            if handle.digest not in self._pools:
                self._pools[handle.digest] = self._fetch(handle, document)
            return self._pools[handle.digest]

    def _fetch(self, handle: PoolHandle, document: Sequence[dict[str, str]] | str | None) -> SharedKVPool:
        try:
            found = ray.get(pool_directory(self._namespace).lookup.remote(handle.digest))
            if found is not None:
                stored = ray.get(found[0])
                pool = from_stored(stored, digest=handle.digest)
                self.fetches[handle.digest] += 1
                self.fetched_nbytes[handle.digest] += stored_nbytes(stored)
                POOL_REGISTRY.put(pool)
                return pool
        except _POOL_LOST as e:
            logger.warning("pool %s is lost from the object store (%s); recovering it", handle.digest[:12], e)
        return self._recover(handle, document)

    def _recover(self, handle: PoolHandle, document: Sequence[dict[str, str]] | str | None) -> SharedKVPool:
        """The pool from the handle's store, else rebuilt from its document; published again either way."""
        model, tokenizer = self._model()
        builds_before = POOL_REGISTRY.build_count
        try:
            pool = POOL_REGISTRY.resolve(handle, model, tokenizer, document=document)
        except PoolNotFoundError as e:
            msg = (
                f"pool {handle.digest[:12]} is neither in the cluster's object store nor in a store, and the call "
                "has no document to rebuild it from; run the prefetch step again"
            )
            raise PoolNotFoundError(msg) from e
        built = POOL_REGISTRY.build_count > builds_before
        if built:
            self.builds[handle.digest] += 1
        self._publish(pool, built=built)
        return pool

    # ---------------------------------------------------------------- calls

    def invoke(
        self,
        settings: dict[str, Any],
        messages: list[BaseMessage],
        kwargs: dict[str, Any],
        handle: PoolHandle | None,
        document: Sequence[dict[str, str]] | str | None,
    ) -> AIMessage:
        """One chat call on this node's model, over this node's copy of the pool."""
        with self._lock:
            self.calls += 1
        chat = ChatPolyKV(**settings)
        if handle is not None:
            chat = chat.with_pool(self._pool(handle, document))
        return chat.invoke(messages, **kwargs)

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
            "pools_nbytes": {digest: pool.nbytes for digest, pool in self._pools.items()},
        }

    def pid(self) -> int:
        return os.getpid()
