"""The :class:`Engine`: everything a process keeps between calls, in one object that can be passed around.

An engine holds
- ``models``: loaded models and tokenizers, one copy per (name, dtype, device, weights);
- ``pools``: the pools by digest, under a byte budget (:class:`~polykv_agents.pool.registry.PoolRegistry`);
- ``schedulers``: the live batch schedulers, one per (model, pool, residency)
  (:class:`~polykv_agents.runtime.scheduler_table.SchedulerTable`), and what finished calls over each pool
  ran through the model, for later calls to reuse (``schedulers.prefixes``, a
  :class:`~polykv_agents.runtime.prefix_tree.PrefixTrees` under its own byte budget, and ``schedulers.blocks``
  for calls that read it at other positions, off unless given a budget),
and turns a runtime name into a :class:`~polykv_agents.runtime.backend.Backend`.

``ChatPolyKV``, ``PrefetchDocument``, ``PooledAgent`` and the graphs take an engine, or use the
process-wide default (:func:`default_engine`). A prefetch into an engine and role calls on it touch
nothing else, so tests, benchmarks and multi-tenant servers can keep engines apart.

Two memos stay attached to the objects they describe instead: a model's fingerprint
(:mod:`polykv_agents.model.fingerprint`) and a tokenizer's grammar vocabulary and template probe
(:mod:`polykv_agents.sampling.grammar`, :mod:`polykv_agents.prompting.tool_prompts`). They are pure
functions of those objects, kept weakly, and give the same answer in every engine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.model.dtype import DtypeName
from polykv_agents.model.loading import ModelCache
from polykv_agents.model.weights import WeightsChoice
from polykv_agents.pool.registry import DEFAULT_MAX_BYTES, PoolRegistry
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.pool.store import PoolStore
from polykv_agents.runtime.backend import Backend, BatchedBackend, PrivateBackend, Runtime, check_runtime
from polykv_agents.runtime.call_limit import DEFAULT_MAX_CALLS, DEFAULT_WAIT_SECONDS
from polykv_agents.runtime.scheduler import SCHEDULER_IDLE_SECONDS
from polykv_agents.runtime.scheduler_table import DEFAULT_PREFIX_BYTES, SchedulerTable

BUDGET_ENV_VAR = "POLYKV_POOL_BUDGET_BYTES"
"""Environment variable that sets the default engine's pool budget in bytes."""

PREFIX_BUDGET_ENV_VAR = "POLYKV_PREFIX_BUDGET_BYTES"
"""Environment variable that sets the default engine's budget for reusable call prefixes in bytes (0: no reuse)."""

SPILL_ENV_VAR = "POLYKV_POOL_SPILL_DIR"
"""Environment variable that sets the directory the default engine's evicted pools are written to."""

COMPILE_ENV_VAR = "POLYKV_COMPILE_DECODE"
"""Environment variable that turns on the default engine's compiled decode steps (``1``; ``0`` or unset: eager)."""


class Engine:
    """Models, pools and schedulers shared by every agent and chat model that uses this engine.

    Args:
        max_pool_bytes: Byte budget of the pools held and of the decoded prefixes the schedulers hold for them
            (least recently used pools evicted beyond it, their idle schedulers retired; a pool in use never is);
            ``None``: unbounded.
        spill_dir: Where pools evicted by that budget are written, so that a later call over the same document
            loads its pool back instead of prefilling it again (``PoolStore`` files, by digest); ``None``: they are
            forgotten. The default engine takes it from ``POLYKV_POOL_SPILL_DIR``.
        scheduler_idle_seconds: Seconds a batch scheduler waits without work before it retires (freeing
            its thread and decoded prefix); ``None``: never.
        compile_decode: Batched decode steps through ``torch.compile`` (see
            :class:`~polykv_agents.runtime.compiled_decode.CompiledDecoder`): faster steps after a compilation
            of tens of seconds per batch-size bucket. Eager where no C++ toolchain can build the step
            (``fallback_reason`` says why); any other compile error reaches the call.
        max_prefix_bytes: Byte budget of the keys and values that finished calls leave for later calls over the
            same pool to reuse (a ReAct step, a follow-up turn, a prompt that extends another's); least recently
            used first out beyond it. ``0`` turns reuse off: every call prefills all of its own tokens.
        max_block_bytes: Byte budget of the text finished calls leave for calls with ``reuse="blocks"``, which read
            it at other positions (:mod:`~polykv_agents.runtime.block_store`); ``0`` (the default): none kept, and
            such calls are refused. An opt-in: moved keys and values are an approximation.
        max_calls: Calls served at once over all pools and models, decoding or waiting for a row (``None``: no
            limit): the engine's backpressure. A call beyond it waits up to ``call_wait_seconds`` for one to end,
            then is refused with :class:`~polykv_agents.runtime.call_limit.EngineBusyError`, never run out of memory.
        call_wait_seconds: How long a call beyond ``max_calls`` waits for a place.
    """

    def __init__(
        self,
        *,
        max_pool_bytes: int | None = DEFAULT_MAX_BYTES,
        spill_dir: str | os.PathLike[str] | None = None,
        scheduler_idle_seconds: float | None = SCHEDULER_IDLE_SECONDS,
        compile_decode: bool | str | Callable = False,
        max_prefix_bytes: int = DEFAULT_PREFIX_BYTES,
        max_block_bytes: int = 0,
        max_calls: int | None = DEFAULT_MAX_CALLS,
        call_wait_seconds: float = DEFAULT_WAIT_SECONDS,
    ) -> None:
        self.models = ModelCache()
        self.schedulers = SchedulerTable(
            on_started=lambda: self.pools.enforce_budget(),
            idle_seconds=scheduler_idle_seconds,
            compile_decode=compile_decode,
            max_prefix_bytes=max_prefix_bytes,
            max_block_bytes=max_block_bytes,
            max_calls=max_calls,
            call_wait_seconds=call_wait_seconds,
        )
        # The budget counts the decoded prefixes the schedulers hold for each pool, and frees them with it.
        spill = None if spill_dir is None else PoolStore(spill_dir)
        self.pools = PoolRegistry(max_bytes=max_pool_bytes, spill=spill, run_time=self.schedulers)
        self._backends: dict[str, Backend] = {
            "auto": BatchedBackend(self.schedulers, "auto"),
            "decompressed": BatchedBackend(self.schedulers, "decompressed"),
            "compressed": BatchedBackend(self.schedulers, "compressed"),
            "private": PrivateBackend(),
        }

    def __repr__(self) -> str:
        return f"Engine(models={len(self.models)}, pools={self.pools!r}, schedulers={len(self.schedulers)})"

    def load_model(
        self,
        name_or_path: str | None = None,
        *,
        dtype: torch.dtype | DtypeName | None = "auto",
        device: str = "cpu",
        weights: WeightsChoice = "auto",
    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """``(model, tokenizer)``, loaded once per engine; see :meth:`ModelCache.load`."""
        return self.models.load(name_or_path, dtype=dtype, device=device, weights=weights)

    def backend(self, runtime: Runtime) -> Backend:
        """The backend named ``runtime`` (``auto``, ``decompressed``, ``compressed`` or ``private``)."""
        return self._backends[check_runtime(runtime)]

    def warm_up_decode(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        pool: SharedKVPool,
        *,
        buckets: tuple[int, ...] | None = None,
    ) -> dict[int, float]:
        """With ``compile_decode``: compile the batched decode step over ``pool`` now, for ``buckets`` of rows
        (default: all), so that no call pays for compiling; the seconds each bucket took (``{}`` without
        ``compile_decode``). The graphs are kept per model: other pools on the same model reuse them."""
        if not self.schedulers.compile_decode:
            return {}  # and no scheduler started before a call needs one
        return self.schedulers.scheduler_for(model, tokenizer, pool, "decompressed").warm_up(buckets)

    def close(self) -> None:
        """Stop this engine's schedulers and forget its pools and models (objects still held elsewhere live on)."""
        self.schedulers.close()
        self.pools.clear()
        self.models.clear()


_DEFAULT: Engine | None = None
_DEFAULT_LOCK = threading.Lock()


def default_engine() -> Engine:
    """The process-wide engine (created on first use; its pool budget comes from ``POLYKV_POOL_BUDGET_BYTES``, the
    directory its evicted pools spill to from ``POLYKV_POOL_SPILL_DIR``,
    its reusable prefixes' budget from ``POLYKV_PREFIX_BUDGET_BYTES``, and ``POLYKV_COMPILE_DECODE=1`` compiles
    its decode steps)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Engine(
                max_pool_bytes=_bytes_from_environment(BUDGET_ENV_VAR, DEFAULT_MAX_BYTES),
                spill_dir=os.environ.get(SPILL_ENV_VAR) or None,
                compile_decode=_compile_from_environment(),
                max_prefix_bytes=_bytes_from_environment(PREFIX_BUDGET_ENV_VAR, DEFAULT_PREFIX_BYTES),
            )
        return _DEFAULT


def load_model(
    name_or_path: str | None = None,
    *,
    dtype: torch.dtype | DtypeName | None = "auto",
    device: str = "cpu",
    weights: WeightsChoice = "auto",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer through the default engine, once per process.

    Args:
        name_or_path: ``None`` (or ``"SmolLM2-135M-Instruct"``) for the embedded model, else a
            local directory or a hub id already in the local cache.
        dtype: Weights and compute dtype. ``"auto"`` (default): bf16 where the device computes it natively
            (AVX-512 bf16 or AMX CPUs, CUDA), else fp32 (fp16 on older GPUs); ``POLYKV_DTYPE`` can say what
            ``auto`` means. ``None`` keeps the checkpoint's (fp32 for the embedded GGUF). See
            :mod:`polykv_agents.model.dtype`.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, or ``"auto"`` (CUDA, then MPS, then the CPU).
        weights: ``"auto"`` (default): weight-only ``"int8"`` where the int8 tile kernel runs (a bf16 model on
            a CPU with AMX), else ``"native"``; ``POLYKV_WEIGHTS`` can say what ``auto`` means. Or name one:
            ``"native"`` (the model's dtype), ``"int8"`` / ``"int4"`` on the CPU: faster decode steps, the same
            pools (see :mod:`polykv_agents.model.weights`; ``python -m benchmarks weights`` measures speed and
            perplexity).

    Raises:
        ModelNotFoundError: The model is not on this machine; the message names the fix.
        TypeError: The checkpoint is not a causal LM.
        DeviceNotAvailableError: A device this machine or torch build does not have (a ``ValueError``).
        ValueError: An unknown dtype or weights, or quantized weights off the CPU.
    """
    return default_engine().load_model(name_or_path, dtype=dtype, device=device, weights=weights)


def _bytes_from_environment(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        msg = f"{name} must be a whole number of bytes, got {value!r}"
        raise ValueError(msg) from None


def _compile_from_environment() -> bool:
    value = os.environ.get(COMPILE_ENV_VAR, "0").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        msg = f"{COMPILE_ENV_VAR} must be 1 (compiled decode steps) or 0 (eager), got {value!r}"
        raise ValueError(msg)
    return value in ("1", "true")
