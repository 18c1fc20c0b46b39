"""The shared document pool: built once, compressed, read by every agent, saved and found again.

Data flow: a document -> :mod:`~polykv_agents.pool.documents` (token ids) -> :mod:`~polykv_agents.pool.prefill`
(a transformers cache) -> :class:`SharedKVPool` (codes, via :mod:`polykv_agents.codecs`) -> held by a
:class:`PoolRegistry`, named in graph state by a :class:`PoolHandle`, saved by a :class:`PoolStore`
(:mod:`~polykv_agents.pool.record` is the tensors + JSON header form both the store and Ray use).
Several documents' pools are read as one by :func:`compose_pools` (:mod:`~polykv_agents.pool.compose`).
"""

from __future__ import annotations

from polykv_agents.pool.compose import compose_pools
from polykv_agents.pool.handle import PoolHandle, PoolHandleState
from polykv_agents.pool.memory import MemoryReport
from polykv_agents.pool.registry import PoolNotFoundError, PoolRegistry
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.pool.store import PoolStore

__all__ = [
    "MemoryReport",
    "PoolHandle",
    "PoolHandleState",
    "PoolNotFoundError",
    "PoolRegistry",
    "PoolStore",
    "SharedKVPool",
    "compose_pools",
]
