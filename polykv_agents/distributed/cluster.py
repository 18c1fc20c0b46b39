"""RayCluster: the driver's view of a Ray cluster that runs pooled agents, one model replica per node.

Data flow:
  RayCluster(model=...) -> one NodeWorker actor pinned to each alive node (started on first use)
  -> ``prefetch(document)``: one worker prefills and compresses the document and publishes the pool into the
     object store (owned by the cluster's pool directory) -> a PoolHandle for graph state
  -> ``invoke(...)`` per agent call: the next worker in turn (calls spread over the nodes), which fetches
     the pool once for its node; if that worker dies mid-call (its process or its node), the call is sent
     again to another worker, so the run completes.

Ray itself must be started first (``ray.init(...)`` or ``RayCluster(address=...)``). Nothing here downloads
anything: every node loads the model from its own disk, as :func:`polykv_agents.load_model` does.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from langchain_core.messages import AIMessage, BaseMessage
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from polykv_agents.config import CompressionConfig
from polykv_agents.distributed.directory import adopt, pool_directory
from polykv_agents.distributed.worker import CONTROL_GROUP, NodeWorker
from polykv_agents.model.loading import DEFAULT_MODEL
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.shared_pool import SharedKVPool

logger = logging.getLogger(__name__)

# What a call sees when its worker's process or node is gone: ActorDiedError and ActorUnavailableError
# (RayActorError's subclasses), and ActorUnschedulableError (a RayError) for a worker whose node is gone.
_WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)


# Bookkeeping calls (stats, stored_pool, ...) get threads of their own: Ray takes the groups only here.
_NodeWorkerActor = ray.remote(concurrency_groups={CONTROL_GROUP: 2})(NodeWorker)

_NODES_REFRESH_S = 5.0
"""How long the list of alive nodes is trusted before Ray is asked again (each ask is a request to its GCS)."""


class NoWorkerError(RuntimeError):
    """No live worker is left to run a call."""


class RayCluster:
    """Agents spread over a Ray cluster: one model replica per node, one fetch of each pool per node.

    Args:
        model: The model every replica loads (a name :func:`polykv_agents.load_model` knows, or a local
            directory present on every node).
        device: Where each replica runs.
        address: A Ray address to connect to, on first use, when Ray is not started yet (``None``: start or
            join as ``ray.init()`` does).
        namespace: The Ray namespace of the pool directory and workers.
        max_concurrency: Calls one worker runs at once (threads; they share its batched scheduler).
        num_cpus: CPUs Ray reserves for each worker (Ray gives it as many torch threads).
        num_gpus: GPUs Ray reserves for each worker (default: 1 for a ``cuda`` device, else 0; Ray hides
            the GPUs from an actor that reserves none).
        nodes: Node ids to place workers on (default: every alive node).
        max_attempts: Workers one call may be sent to before it fails.
        rejoin_after_s: Seconds a node whose worker died gets no new one: long enough for Ray to notice a
            node that is gone (about 14 s by default), so no worker is pinned to it meanwhile.
    """

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL,
        device: str = "cpu",
        address: str | None = None,
        namespace: str = "polykv",
        max_concurrency: int = 16,
        num_cpus: float = 1,
        num_gpus: float | None = None,
        nodes: Sequence[str] | None = None,
        max_attempts: int = 3,
        rejoin_after_s: float = 30.0,
    ) -> None:
        self.address = address
        self.model = model
        self.device = device
        self.namespace = namespace
        self.max_concurrency = max_concurrency
        self.num_cpus = num_cpus
        self.num_gpus = (1 if device.startswith("cuda") else 0) if num_gpus is None else num_gpus
        self.max_attempts = max_attempts
        self.rejoin_after_s = rejoin_after_s
        self._node_ids = list(nodes) if nodes is not None else None
        self._lock = threading.Lock()
        self._workers: dict[str, Any] = {}  # node id -> live NodeWorker handle
        self._lost: dict[str, float] = {}  # node id -> when its worker died (monotonic seconds)
        self._alive: list[str] = []  # alive node ids, as ray.nodes() last said
        self._alive_checked = -float("inf")
        self._turn = itertools.count()

    def __deepcopy__(self, memo: dict) -> RayCluster:
        return self  # a handle on shared resources, like a client: copies of a chat model share it

    # ---------------------------------------------------------------- workers

    def _connect(self) -> None:
        if not ray.is_initialized():  # on first use: constructing a cluster object starts nothing
            ray.init(address=self.address, namespace=self.namespace)

    def _alive_nodes(self) -> list[str]:
        """Nodes that may have a worker: alive (ray.nodes(), asked at most every few seconds, and after any
        loss), allowed, and not in their time out after losing a worker. Hold ``_lock``."""
        now = time.monotonic()
        if now - self._alive_checked > _NODES_REFRESH_S:
            self._alive = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
            self._alive_checked = now
        return [
            node_id
            for node_id in self._alive
            if (self._node_ids is None or node_id in self._node_ids)
            and now - self._lost.get(node_id, -float("inf")) > self.rejoin_after_s
        ]

    def workers(self) -> dict[str, Any]:
        """One worker per alive node, started where missing: node id -> actor handle."""
        self._connect()
        with self._lock:
            for node_id in self._alive_nodes():
                if node_id not in self._workers:
                    self._workers[node_id] = _NodeWorkerActor.options(
                        num_cpus=self.num_cpus,
                        num_gpus=self.num_gpus,
                        max_concurrency=self.max_concurrency,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                        namespace=self.namespace,
                    ).remote(self.model, self.device, self.namespace)
            return dict(self._workers)

    def warm_up(self) -> dict[str, float]:
        """Start every node's worker and load its model replica now; node id -> seconds the load took."""
        workers = self.workers()
        return dict(zip(workers, ray.get([worker.load.remote() for worker in workers.values()]), strict=True))

    def _drop(self, node_id: str, worker: Any) -> None:
        with self._lock:
            if self._workers.get(node_id) is worker:
                del self._workers[node_id]
            self._lost[node_id] = time.monotonic()
            self._alive_checked = -float("inf")  # ask Ray again which nodes are alive

    def _on_some_worker(self, call: Callable[[Any], Any]) -> Any:
        """``ray.get(call(worker))`` on the next worker in turn; a worker that dies is dropped and the call
        goes to another (up to ``max_attempts`` workers)."""
        last_error: BaseException | None = None
        for _ in range(self.max_attempts):
            workers = sorted(self.workers().items())
            if not workers:
                break
            node_id, worker = workers[next(self._turn) % len(workers)]
            try:
                return ray.get(call(worker))
            except _WORKER_LOST as e:
                if isinstance(e, ray.exceptions.RayTaskError):  # the call ran and raised: not a lost worker
                    raise
                logger.warning("worker on node %s was lost (%s); sending the call to another node", node_id[:8], e)
                self._drop(node_id, worker)
                last_error = e
        msg = f"no live worker could run the call after {self.max_attempts} attempts; check the cluster's nodes"
        raise NoWorkerError(msg) from last_error

    # ---------------------------------------------------------------- pools and calls

    def prefetch(
        self,
        document: Sequence[dict[str, str]] | str,
        *,
        config: CompressionConfig | None = None,
        store_dir: str | None = None,
    ) -> PoolHandle:
        """Build ``document``'s pool on one worker (or find it built) and publish it; its handle."""
        config_json = (config or CompressionConfig()).model_dump(mode="json")
        documents = document if isinstance(document, str) else [dict(m) for m in document]
        return self._on_some_worker(lambda worker: worker.build.remote(documents, config_json, store_dir))

    def publish(self, pool: SharedKVPool, *, store_dir: str | None = None) -> PoolHandle:
        """Put a pool built in this process into the cluster's object store; its handle (``store_dir``: where
        it is also saved, if it is)."""
        self._connect()
        return PoolHandle.from_pool(pool, store_dir=store_dir, object_id=adopt(pool, self.namespace))

    def invoke(
        self,
        settings: dict[str, Any],
        messages: Sequence[BaseMessage],
        kwargs: dict[str, Any],
        handle: PoolHandle | None,
        document: Sequence[dict[str, str]] | str | None,
    ) -> AIMessage:
        """One chat call (``ChatPolyKV(**settings)`` over ``handle``'s pool) on some worker."""
        messages = list(messages)
        return self._on_some_worker(lambda worker: worker.invoke.remote(settings, messages, kwargs, handle, document))

    def release(self, digest: str) -> None:
        """Free pool ``digest`` across the cluster: the directory forgets it (its object is freed once no one holds
        it) and every worker drops its copy (once no call is using it)."""
        self._connect()
        ray.get(pool_directory(self.namespace).forget.remote(digest))
        ray.get([worker.release.remote(digest) for worker in self.workers().values()])

    def shutdown(self) -> None:
        """Stop this cluster object's workers (the pool directory and its pools stay for other drivers)."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            ray.kill(worker)

    def stats(self) -> list[dict[str, Any]]:
        """Each live worker's measurements (node, pid, RSS, calls, fetches and bytes fetched, builds)."""
        return ray.get([worker.stats.remote() for worker in self.workers().values()])

    def pool_locations(self, digest: str) -> dict[str, Any] | None:
        """The nodes holding a copy of pool ``digest`` and the size of one copy, as Ray's object directory reports
        it: every node that fetched the pool holds one copy, what crossed to it."""
        self._connect()
        return ray.get(pool_directory(self.namespace).locations.remote(digest))

    def object_store_stats(self) -> dict[str, dict[str, int]]:
        """Each alive node's object store, as its raylet reports it: bytes ``used``, bytes of ``primary`` copies
        (objects created on that node), ``secondary`` = used - primary (copies pulled in from other nodes), and
        ``cumulative_created`` (every byte ever written there, pulls included). Read through Ray's internal
        ``node_stats`` call, the one ``ray memory`` makes (needs grpcio, part of the ``ray`` extra)."""
        from ray._private import internal_api  # no public API gives per-node store counters without ray[default]

        self._connect()
        stats = {}
        for node in ray.nodes():
            if node["Alive"]:
                store = internal_api.node_stats(
                    node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False
                ).store_stats
                used, primary = int(store.object_store_bytes_used), int(store.object_store_bytes_primary_copy)
                stats[node["NodeID"]] = {
                    "used": used,
                    "primary": primary,
                    "secondary": used - primary,
                    "cumulative_created": int(store.cumulative_created_bytes),
                }
        return stats

    def directory_stats(self) -> dict[str, Any]:
        """The pool directory's builds and publications per digest."""
        self._connect()
        return ray.get(pool_directory(self.namespace).stats.remote())
