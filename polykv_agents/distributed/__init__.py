"""Scale out on Ray: one compressed pool in the object store, agents on any node of a cluster.

Install with ``pip install "polykv-agents[ray]"``.

Data flow:
  RayCluster(model=...)            one NodeWorker actor per node, each with one model replica
  -> cluster.prefetch(document)    one worker prefills and compresses the document, puts the pool's packed
                                   tensors + JSON header into the object store (owned by the cluster's pool
                                   directory) -> a PoolHandle (digest + object id) for graph state
  -> RayChatPolyKV.on(cluster, chat).with_pool(handle).invoke(...)
                                   the call runs on the next worker in turn; each node fetches the pool once
                                   (a zero-copy read of its shared memory for every later call on that node)
                                   and batches its concurrent calls as one process does
In LangGraph: ``build_graph(cluster=RayCluster(...))`` in graphs/ (``PrefetchDocument(..., cluster=...)``).
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # the optional extra
    msg = 'polykv_agents.distributed needs Ray: pip install "polykv-agents[ray]"'
    raise ImportError(msg) from e

from polykv_agents.distributed.chat import RayChatPolyKV
from polykv_agents.distributed.cluster import NoWorkerError, RayCluster

__all__ = ["NoWorkerError", "RayChatPolyKV", "RayCluster"]
