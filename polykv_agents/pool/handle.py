"""PoolHandle: the small, serializable stand-in for a pool that LangGraph state holds instead of tensors.

A graph's prefetch node builds a :class:`~polykv_agents.pool.shared_pool.SharedKVPool` into its engine's
pool registry (``engine.pools``, a :class:`~polykv_agents.pool.registry.PoolRegistry`), optionally saves it
to a :class:`~polykv_agents.pool.store.PoolStore`, and puts ``PoolHandle.from_pool(pool, store_dir=...)``
into the state. Agent nodes turn the handle back into the pool with ``engine.pools.resolve(...)``: from
the registry, else from the store, else by rebuilding it from the document.

Graph state holds the handle as plain JSON (:class:`PoolHandleState`, ``handle.to_state()``): any
checkpointer stores it as it stores a string, with no allow-list and no "unregistered type" warning on
resume, and LangGraph Studio shows it as it is. Everything that reads a handle (``ChatPolyKV.with_pool``,
``PoolRegistry.resolve``, the Ray workers) takes either form and checks it with
``PoolHandle.model_validate``, so ``PoolHandle`` objects put into state by older code still work.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from polykv_agents.config import CompressionConfig
from polykv_agents.model.fingerprint import ModelFingerprint

if TYPE_CHECKING:
    from polykv_agents.pool.shared_pool import SharedKVPool


class PoolHandleState(TypedDict):
    """A :class:`PoolHandle` as graph state holds it: plain JSON values (``PoolHandle.to_state()``)."""

    digest: str
    fingerprint: dict[str, Any]
    config: dict[str, Any]
    num_tokens: int
    nbytes: int
    store_dir: str | None
    object_id: str | None


class PoolHandle(BaseModel):
    """What graph state holds for a pool: its digest plus enough to check and rebuild it, never tensors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    """``SharedKVPool.digest``: the key in the registry and the store's file name."""

    fingerprint: ModelFingerprint
    """The model the pool was built with; resolving with another model is refused."""

    config: CompressionConfig
    """How the pool is compressed; a rebuild from the document uses it, so it reproduces the digest."""

    num_tokens: int = Field(ge=1)
    """Tokens in the pool's document (informational)."""

    nbytes: int = Field(ge=0)
    """Bytes the pool stores (informational: what the state saves by not holding it)."""

    store_dir: str | None = None
    """Directory of a :class:`~polykv_agents.pool.store.PoolStore` holding a saved copy, as an absolute path;
    ``None``: the pool lives only in the registry of the process that built it."""

    object_id: str | None = Field(default=None, pattern=r"^[0-9a-f]+$")
    """The pool's object in a Ray cluster's object store (``ObjectRef.hex()``), when it was published there
    (:mod:`polykv_agents.distributed`); the ref itself stays with the cluster's pool directory, which
    workers ask by digest. ``None``: not published."""

    @classmethod
    def from_pool(
        cls, pool: SharedKVPool, store_dir: str | os.PathLike[str] | None = None, *, object_id: str | None = None
    ) -> PoolHandle:
        """The handle of ``pool``; ``store_dir`` is where it was saved, if it was, ``object_id`` where it was
        published, if it was.

        The directory is made absolute so a thread resumed from another working directory finds it.
        """
        return cls(
            digest=pool.digest,
            fingerprint=pool.fingerprint,
            config=pool.config,
            num_tokens=pool.num_tokens,
            nbytes=pool.nbytes,
            store_dir=None if store_dir is None else str(Path(store_dir).absolute()),
            object_id=object_id,
        )

    def to_state(self) -> PoolHandleState:
        """This handle as plain JSON values, what graph state holds (``PoolHandle.model_validate`` reads it back)."""
        return PoolHandleState(**self.model_dump(mode="json"))
