"""The pool directory: one named Ray actor per cluster namespace that maps pool digests to the object refs of
published pools, and owns those objects.

Why an actor: an ``ObjectRef`` cannot go into a LangGraph checkpoint (Ray refuses, or pins the object for
ever, when a ref is serialized outside its own protocol), and an object dies with its owner. Ray makes the
caller of a task the owner of what the task returns, so the directory asks the worker that built a pool
for it (``publish_from``): the bytes stay in that worker's node, the ownership is the directory's, and the
pool outlives the worker's process. (``ray.put(_owner=...)`` did this until Ray 2.56 removed it.) A pool
built outside any worker is handed over whole (``adopt``). Any process of the cluster finds a pool by
digest. If the directory itself is lost, its objects are lost with it; workers then rebuild the pool from
its store or its document and publish it again (:mod:`polykv_agents.distributed.worker`).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import ray

from polykv_agents.distributed.object_store import to_stored
from polykv_agents.pool.shared_pool import SharedKVPool

DIRECTORY_NAME = "polykv-pool-directory"
"""The directory actor's name inside the cluster's namespace."""

HEAD_NODE_RESOURCE = "node:__internal_head__"
"""The custom resource Ray gives the head node only: asking for a sliver of it places an actor there."""


@ray.remote(num_cpus=0)
class PoolDirectory:
    """digest -> the ObjectRef of the published pool, plus what was built and published where."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the actor runs a few calls at once (see pool_directory)
        self._refs: dict[str, ray.ObjectRef] = {}
        self._object_ids: dict[str, str] = {}
        self._builds: Counter[str] = Counter()
        self._publications: Counter[str] = Counter()

    def _keep(self, digest: str, ref: ray.ObjectRef, built: bool) -> str:
        """File ``ref`` under ``digest``; hold ``_lock``."""
        self._refs[digest] = ref
        self._object_ids[digest] = ref.hex()
        self._publications[digest] += 1
        self._builds[digest] += built
        return self._object_ids[digest]

    def publish_from(self, digest: str, worker: ray.actor.ActorHandle, built: bool, replace: bool) -> str:
        """File the pool ``worker`` holds under ``digest``, owned by this directory (it asks the worker for the
        stored pool, without waiting: readers' ``ray.get`` waits); returns its object id. A pool filed already is
        kept, unless ``replace`` (its object was lost)."""
        with self._lock:  # one check-and-file: two workers publishing one pool at once file it once
            if digest in self._refs and not replace:
                self._builds[digest] += built
                return self._object_ids[digest]
            return self._keep(digest, worker.stored_pool.remote(digest), built)

    def adopt(self, digest: str, stored: list[ray.ObjectRef]) -> str:
        """File a stored pool handed over whole (one built in a driver; passed in a list, so Ray hands over the
        ref, and the copy is this directory's own: it outlives the driver); returns its object id."""
        with self._lock:
            if digest in self._refs:
                return self._object_ids[digest]
        own = ray.put(ray.get(stored[0]))  # outside the lock: it copies the whole pool
        with self._lock:
            return self._object_ids[digest] if digest in self._refs else self._keep(digest, own, built=False)

    def lookup(self, digest: str) -> list[ray.ObjectRef] | None:
        """``[ref]`` of the pool published under ``digest`` (a list, so the caller gets the ref), or ``None``."""
        ref = self._refs.get(digest)
        return None if ref is None else [ref]

    def locations(self, digest: str) -> dict[str, Any] | None:
        """Where Ray holds copies of pool ``digest`` and how big one is, as the owner's object directory reports
        it (``{"node_ids": [...], "object_size": bytes}``); ``None`` for an unknown digest."""
        ref = self._refs.get(digest)
        if ref is None:
            return None
        ray.wait([ref])  # it exists once the worker that holds the pool has stored it
        return dict(ray.experimental.get_object_locations([ref])[ref])

    def forget(self, digest: str) -> None:
        """Drop ``digest``: its object is freed once no worker holds it."""
        with self._lock:
            self._refs.pop(digest, None)
            self._object_ids.pop(digest, None)

    def stats(self) -> dict[str, Any]:
        """Builds and publications per digest, and the published object ids."""
        with self._lock:
            return {
                "builds": {digest: n for digest, n in self._builds.items() if n},
                "publications": dict(self._publications),
                "objects": dict(self._object_ids),
            }


def pool_directory(namespace: str | None = None) -> ray.actor.ActorHandle:
    """The cluster's pool directory, started if there is none (or if the one there was has died): on the head
    node, the one that lives as long as the cluster, with a few threads so that a ``locations`` call, which
    waits for an object, does not hold up lookups."""
    options = {
        "name": DIRECTORY_NAME,
        "namespace": namespace,
        "get_if_exists": True,
        "lifetime": "detached",
        "max_concurrency": 4,
        "resources": {HEAD_NODE_RESOURCE: 0.001},
    }
    return PoolDirectory.options(**options).remote()


def adopt(pool: SharedKVPool, namespace: str | None) -> str:
    """Hand ``pool`` (built in this process) to the cluster's directory, which puts it into the object store
    and owns it; returns the object id. A pool the directory has already is not sent again."""
    directory = pool_directory(namespace)
    filed = ray.get(directory.stats.remote())["objects"].get(pool.digest)
    return filed if filed is not None else ray.get(directory.adopt.remote(pool.digest, [ray.put(to_stored(pool))]))
