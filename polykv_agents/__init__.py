"""polykv_agents: many LLM agents over one document, paying for its KV cache once, compressed.

Prefill a document once into a :class:`SharedKVPool` (int8 keys, 3-bit TurboQuant values), then
let any number of :class:`PooledAgent` s answer from it without re-reading the document.
"""

from __future__ import annotations

from polykv_agents.agent import PooledAgent
from polykv_agents.config import CodecConfig, CompressionConfig
from polykv_agents.model.fingerprint import ModelFingerprint
from polykv_agents.model.loading import DEFAULT_MODEL, ModelNotFoundError, load_model
from polykv_agents.pool.memory import MemoryReport
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.sampling.settings import GenerationSettings

__all__ = [
    "DEFAULT_MODEL",
    "CodecConfig",
    "CompressionConfig",
    "GenerationSettings",
    "MemoryReport",
    "ModelFingerprint",
    "ModelNotFoundError",
    "PooledAgent",
    "SharedKVPool",
    "load_model",
]

__version__ = "0.1.0"
