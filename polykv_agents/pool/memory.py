"""Memory accounting for pools: what one shared pool costs against one cache per agent.

Every byte count here comes from ``nbytes`` of real tensors measured when the pool was built;
the N-agent totals multiply those measured single-copy sizes by N, and are labelled as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from polykv_agents.pool.shared_pool import SharedKVPool


class MemoryReport(BaseModel):
    """KV memory of one pool read by ``n_agents`` against ``n_agents`` separate caches."""

    model_config = ConfigDict(frozen=True)

    n_agents: int
    num_tokens: int
    model_dtype: str
    pool_nbytes: int
    """Measured: stored codes, scales and norms. Flat in ``n_agents``."""
    single_cache_fp16_nbytes: int
    """Measured: the uncompressed cache of this document, cast to fp16."""
    single_cache_model_dtype_nbytes: int
    """Measured: the uncompressed cache of this document, as the model produced it."""

    @classmethod
    def for_pool(cls, pool: SharedKVPool, n_agents: int) -> MemoryReport:
        if n_agents < 1:
            msg = f"n_agents must be at least 1, got {n_agents}"
            raise ValueError(msg)
        return cls(
            n_agents=n_agents,
            num_tokens=pool.num_tokens,
            model_dtype=pool.fingerprint.dtype,
            pool_nbytes=pool.nbytes,
            single_cache_fp16_nbytes=pool.fp16_nbytes,
            single_cache_model_dtype_nbytes=pool.model_dtype_nbytes,
        )

    @property
    def separate_fp16_nbytes(self) -> int:
        """``n_agents`` separate fp16 caches (N x the measured single copy)."""
        return self.n_agents * self.single_cache_fp16_nbytes

    @property
    def separate_model_dtype_nbytes(self) -> int:
        """``n_agents`` separate caches in the model's dtype (N x the measured single copy)."""
        return self.n_agents * self.single_cache_model_dtype_nbytes

    @property
    def saving_vs_fp16(self) -> float:
        """Fraction of KV memory saved against N separate fp16 caches."""
        return 1.0 - self.pool_nbytes / self.separate_fp16_nbytes

    def rows(self) -> list[tuple[str, int]]:
        """``(label, bytes)`` rows for tables."""
        return [
            ("shared pool (compressed, measured)", self.pool_nbytes),
            ("1 uncompressed cache, fp16 (measured)", self.single_cache_fp16_nbytes),
            (f"1 uncompressed cache, {self.model_dtype} (measured)", self.single_cache_model_dtype_nbytes),
            (
                f"{self.n_agents} separate caches, fp16 ({self.n_agents} x measured)",
                self.separate_fp16_nbytes,
            ),
            (
                f"{self.n_agents} separate caches, {self.model_dtype} ({self.n_agents} x measured)",
                self.separate_model_dtype_nbytes,
            ),
        ]
