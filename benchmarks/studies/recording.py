"""An engine that records every call it decodes: which graph node made it, the tokens the model read and
the tokens it decoded, and when. Benchmarks count calls and tokens from the run itself with it, and
replay the very same prompts on a peer engine (:mod:`benchmarks.studies.peers`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from polykv_agents.engine import Engine
from polykv_agents.runtime.backend import Backend, Runtime
from polykv_agents.runtime.request import DecodeRequest


@dataclass
class RecordedCall:
    """One decoded call."""

    node: str
    """The LangGraph node that made it (``langgraph_node``), or ``""`` outside a graph."""
    input_ids: list[int]
    """Every token the model read: the pool's, then the call's prompt."""
    pool_tokens: int
    """How many of ``input_ids`` came from the pool (0 without one)."""
    started_s: float
    """``time.perf_counter()`` when decoding began."""
    ended_s: float = 0.0
    output_tokens: int = 0
    finish_reason: str | None = None


def _current_node() -> str:
    from langchain_core.runnables.config import var_child_runnable_config

    config = var_child_runnable_config.get() or {}
    # A runnable bound with metadata of its own (a role's tags) replaces the config's metadata, but its callback
    # manager still carries what it inherited from the node, as traces do.
    inherited = getattr(config.get("callbacks"), "metadata", None) or {}
    return str(config.get("metadata", {}).get("langgraph_node") or inherited.get("langgraph_node") or "")


@dataclass
class _RecordingBackend:
    inner: Backend
    calls: list[RecordedCall]
    lock: threading.Lock
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.inner.name

    def decode(self, request: DecodeRequest, budget: int) -> Iterator[int]:
        pool_ids = request.pool.token_ids if request.pool is not None else torch.empty(0, dtype=torch.long)
        call = RecordedCall(
            node=_current_node(),
            input_ids=torch.cat([pool_ids, request.prompt_ids.cpu()]).tolist(),
            pool_tokens=pool_ids.numel(),
            started_s=time.perf_counter(),
        )
        with self.lock:
            self.calls.append(call)
        return self._counted(call, request, self.inner.decode(request, budget))

    @staticmethod
    def _counted(call: RecordedCall, request: DecodeRequest, tokens: Iterator[int]) -> Iterator[int]:
        try:
            for token in tokens:
                call.output_tokens += 1
                yield token
        finally:
            tokens.close()
            call.ended_s = time.perf_counter()
            call.finish_reason = request.stats.finish_reason


class RecordingEngine(Engine):
    """An :class:`Engine` whose backends record every call into :attr:`calls` (in the order they began)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[RecordedCall] = []
        self._calls_lock = threading.Lock()

    def backend(self, runtime: Runtime) -> Backend:
        return _RecordingBackend(super().backend(runtime), self.calls, self._calls_lock)

    def take_calls(self) -> list[RecordedCall]:
        """The calls recorded so far, forgetting them."""
        with self._calls_lock:
            calls = list(self.calls)
            self.calls.clear()
        return calls
