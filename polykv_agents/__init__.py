"""polykv_agents: many LLM agents over one document, paying for its KV cache once, compressed.

Prefill a document once into a :class:`SharedKVPool` (int8 keys, 3-bit TurboQuant values), then
let any number of :class:`PooledAgent` s answer from it without re-reading the document.
"""

from __future__ import annotations

from polykv_agents.agent import PooledAgent
from polykv_agents.config import CodecConfig, CompressionConfig
from polykv_agents.fingerprint import ModelFingerprint
from polykv_agents.generation import GenerationSettings
from polykv_agents.memory import MemoryReport
from polykv_agents.models import DEFAULT_MODEL, ModelNotFoundError, load_model
from polykv_agents.pool import SharedKVPool

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
