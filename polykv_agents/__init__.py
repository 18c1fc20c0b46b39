"""polykv_agents: many LLM agents over one document, paying for its KV cache once, compressed.

Prefill a document once into a :class:`SharedKVPool` (int8 keys, 3-bit TurboQuant values), then
let any number of :class:`PooledAgent` s, or :class:`ChatPolyKV` calls in LangChain and LangGraph,
answer from it without re-reading the document. An :class:`Engine` holds the models, pools and
schedulers they share (one process-wide default, or engines of your own). Where each part lives:
docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from polykv_agents.agent import PooledAgent
from polykv_agents.chat.chat_model import ChatPolyKV, ToolCallCutError
from polykv_agents.config import CodecConfig, CompressionConfig, LayerCodecs
from polykv_agents.engine import Engine, default_engine, load_model
from polykv_agents.graph.context import PolyKVContext
from polykv_agents.graph.prefetch import PrefetchDocument
from polykv_agents.graph.workflow import with_parallel_roles
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.model.device import DeviceNotAvailableError
from polykv_agents.model.fingerprint import ModelFingerprint
from polykv_agents.model.loading import DEFAULT_MODEL, ModelNotFoundError
from polykv_agents.pool import MemoryReport, PoolHandle, PoolHandleState, PoolStore, SharedKVPool, compose_pools
from polykv_agents.runtime.call_limit import EngineBusyError
from polykv_agents.sampling.settings import GenerationSettings

__all__ = [
    "DEFAULT_MODEL",
    "ChatPolyKV",
    "CodecConfig",
    "CompressionConfig",
    "DeviceNotAvailableError",
    "Engine",
    "EngineBusyError",
    "GenerationSettings",
    "LayerCodecs",
    "MemoryReport",
    "ModelFingerprint",
    "ModelNotFoundError",
    "PolyKVContext",
    "PoolHandle",
    "PoolHandleState",
    "PoolStore",
    "PooledAgent",
    "PrefetchDocument",
    "SharedKVPool",
    "ToolCallCutError",
    "compose_pools",
    "default_engine",
    "load_model",
    "run_on_compute_thread",
    "with_parallel_roles",
]

__version__ = "0.1.0"
