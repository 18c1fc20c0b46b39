"""A compiled decode step for the batched runtime: gpt-fast's recipe (static shapes, ``torch.compile``) on
the cascade runtime.

An eager decode step of a small model is about a thousand short operations, and on a CPU most of
its time is spent between them, not in them. Compiled, the elementwise work of a layer (norms, rotary
embedding, residuals, the cascade merge) fuses into a few kernels; the matrix products stay library calls.
Attention becomes generated loops where few queries share a kv head (every suffix, and the prefix for one or
two agents: ``cascade_attention._attend_reduced``, over the prefix in two halves so that a document past 4,096
tokens needs no new graph) and stays the fused kernel for the prefix of many agents.

Compiled code wants few shapes, so a compiled step pads what varies:

- rows, to a bucket of :data:`BATCH_BUCKETS` (1, 2, 4, ...): padding rows decode a dummy token into
  slots of their own that no real row reads, and their logits are dropped;
- the suffix capacity, in steps of :data:`CAPACITY_STEP` slots, marked dynamic, as is the document's
  length: one graph serves every answer and document length, so a bucket costs one compilation.

The masks of a step are built before the graph (eager, a handful of small tensors) and passed in.
The suffix cache's own tensors are the graph's static cache: the step writes each row's new key and
value into them in place, so nothing is copied per step.

Falling back: where Inductor cannot build its C++ here (no working compiler, or the compiler refuses what it
generated: :func:`toolchain_failure`), the failure is logged once, :attr:`CompiledDecoder.fallback_reason` says
why, and this decoder runs eager steps from then on (a missing compiler does not come back).
:meth:`CompiledDecoder.require_compiled` raises if that happened, for benchmarks that must measure compiled steps.
Any other failure (a bug in the step, the model or dynamo) is raised to the step's rows, never hidden behind
eager steps. In fp32 compiled and eager steps give the same greedy tokens (tested on six families); in bf16 fused
kernels round differently (``python -m benchmarks compile`` counts the answers that stay identical).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from polykv_agents.model.compat import cache_keyword
from polykv_agents.runtime.cascade_attention import CascadeContext
from polykv_agents.runtime.shared_prefix import SharedPrefix
from polykv_agents.runtime.suffix_cache import SuffixCache

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Row counts a compiled step is built for; a batch is padded up to the next one (more rows run eager)."""

CAPACITY_STEP = 64
"""Suffix slots added at a time in compiled steps (the capacity is a dynamic dimension of the graph)."""


def batch_bucket(rows: int) -> int | None:
    """The smallest bucket of :data:`BATCH_BUCKETS` holding ``rows``; ``None`` above the largest."""
    return next((bucket for bucket in BATCH_BUCKETS if bucket >= rows), None)


class _StaticLayer(CacheLayerMixin):
    """One layer of a compiled step's cache: the suffix cache's own tensors ``[Bb, KVH, C, D]``."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.rows, self.slots = keys, values, rows, slots
        self.device, self.is_initialized = keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the tensors exist already

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write each row's new ``[Bb, KVH, 1, D]`` at its own slot; return all ``C`` slots (masks hide the rest).

        An indexed assignment (``index_put_``), not ``scatter_``: Inductor writes the former in place into the
        cache, while the latter it computes out of place, copying the whole cache twice per layer and step.
        """
        self.keys[self.rows, :, self.slots] = key_states[:, :, 0]
        self.values[self.rows, :, self.slots] = value_states[:, :, 0]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] + query_length, 0

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return -1


class _StaticCache(Cache):
    """The cache a compiled step sees: every layer's padded suffix; row ``r`` writes slot ``slots[r]``."""

    def __init__(self, suffix: SuffixCache, slots: torch.Tensor) -> None:
        rows = torch.arange(slots.numel(), device=slots.device)
        layers = [_StaticLayer(layer.keys, layer.values, rows, slots) for layer in suffix.layers]
        super().__init__(layers=layers)


class _StaticContext(CascadeContext):
    """A cascade context whose masks are built before the graph, one per attention window, for one new
    token per row over all ``capacity`` suffix slots."""

    def __init__(
        self,
        prefix: SharedPrefix,
        past_lengths: torch.Tensor,
        starts: torch.Tensor,
        *,
        capacity: int,
        groups: int,
        windows: tuple[int | None, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(prefix, past_lengths, starts)
        self._static: dict[tuple[str, int | None], torch.Tensor | None] = {}
        for window in windows:
            suffix = CascadeContext.suffix_mask(self, capacity, 1, groups, device, window)
            self._static["suffix", window] = suffix
            self._static["suffix+", window] = CascadeContext.additive(self, suffix, dtype)
            if window is None:
                self._static["prefix", window] = self._static["prefix+", window] = None
            else:  # always built: whether a query is past a whole window is data, not shape
                prefix_mask = self.prefix_window_mask(1, groups, device, window)
                self._static["prefix", window] = prefix_mask
                self._static["prefix+", window] = CascadeContext.additive(self, prefix_mask, dtype)

    def prefix_masks(self) -> list[torch.Tensor]:
        """The prefix masks ``[1, 1, Bb*G, T]`` (boolean and additive) of every sliding window."""
        return [mask for (kind, _), mask in self._static.items() if kind.startswith("prefix") and mask is not None]

    def suffix_masks(self) -> list[torch.Tensor]:
        """The suffix masks ``[Bb, 1, G, C]`` (boolean and additive) of every window."""
        return [mask for (kind, _), mask in self._static.items() if kind.startswith("suffix")]

    def suffix_mask(self, suffix_len, q_len, groups, device, window=None):
        return self._static["suffix", window]

    def prefix_mask(self, q_len, groups, device, window):
        return self._static["prefix", window]

    def additive(self, mask, dtype):
        # By identity, which dynamo resolves while tracing (an id() key would be a new guard every step).
        for (kind, window), built in self._static.items():
            if built is mask and not kind.endswith("+"):
                return self._static[kind + "+", window]
        return None


def cpp_toolchain_available() -> bool:
    """Whether Inductor finds a working C++ compiler here (``torch._inductor.config.cpp.cxx``, run once with
    ``--version``): what generating CPU kernels needs. Tests of real Inductor kernels skip without one."""
    from torch._inductor.cpp_builder import get_cpp_compiler  # imported late: torch._inductor takes a second
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        return False
    return True


def toolchain_failure(error: BaseException) -> BaseException | None:
    """The C++ toolchain error (no working compiler, or a compile that failed) that ``error`` is or wraps, else
    ``None``. Dynamo wraps what a backend raises (``BackendCompilerFailed``, Inductor's ``InductorError``) and keeps
    it as ``inner_exception``, so the chain is walked: wrappers, causes and contexts."""
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (CppCompileError, InvalidCxxCompiler)):
            return current
        pending += [getattr(current, "inner_exception", None), current.__cause__, current.__context__]
    return None


def attention_windows(model: PreTrainedModel) -> tuple[int | None, ...]:
    """Every ``sliding_window`` the model's layers may pass to attention (``None``: full attention)."""
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    return (None,) if window is None else (None, int(window))


RECOMPILE_LIMIT = 256
"""Graphs dynamo may keep for the compiled forward (one per model, batch bucket and dtype, at most)."""

_COMPILED: weakref.WeakKeyDictionary[PreTrainedModel, dict[object, Callable]] = weakref.WeakKeyDictionary()
_COMPILED_LOCK = threading.Lock()


def compiled_forward(model: PreTrainedModel, backend: str | Callable = "inductor") -> Callable:
    """``model``'s compiled decode forward ``(ids [Bb, 1], positions [Bb, 1], cache, context) -> logits [Bb, vocab]``,
    one per model and backend, shared by all its schedulers: a scheduler that retires and comes back, or
    reads another document, reuses the graphs already built."""
    with _COMPILED_LOCK:
        per_model = _COMPILED.setdefault(model, {})
        if backend not in per_model:
            keyword = cache_keyword(model)

            def forward(ids: torch.Tensor, positions: torch.Tensor, cache: Cache, context: CascadeContext):
                return model(
                    input_ids=ids,
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=1,
                    cascade=context,
                    **{keyword: cache},
                ).logits[:, -1]

            per_model[backend] = torch.compile(forward, backend=backend, dynamic=False)
        return per_model[backend]


class CompiledDecoder:
    """Decode steps of one scheduler through ``torch.compile``; eager from the first step Inductor cannot build
    here for want of a C++ toolchain (:attr:`fallback_reason`), and raising on any other failure.

    Args:
        model: The model (already switched to cascade attention).
        prefix: The scheduler's shared prefix (kept decoded: a compressed one decodes layers inside the step).
        backend: ``torch.compile``'s backend (``"inductor"`` generates kernels; tests also use others).
    """

    def __init__(self, model: PreTrainedModel, prefix: SharedPrefix, *, backend: str | Callable = "inductor") -> None:
        self.model = model
        self.prefix = prefix
        self._failed: BaseException | None = None
        self.compile_seconds: dict[int, float] = {}  # batch bucket -> seconds its first step took here
        kv_heads = prefix.layer(0)[0].shape[1]  # from the keys themselves: not every config names it
        self._groups = model.config.get_text_config().num_attention_heads // kv_heads
        self._windows = attention_windows(model)
        self._compiled = compiled_forward(model, backend)
        for keys, values in prefix.layers():  # one graph for every document length (marked once: they stay)
            torch._dynamo.mark_dynamic(keys, 2)
            torch._dynamo.mark_dynamic(values, 2)

    @property
    def failed(self) -> BaseException | None:
        """The error that made this decoder fall back to eager (as dynamo raised it), or ``None``."""
        return self._failed

    @property
    def fallback_reason(self) -> str | None:
        """Why this decoder decodes eager (the toolchain error, by type and message), or ``None`` while it has not
        fallen back."""
        if self._failed is None:
            return None
        cause = toolchain_failure(self._failed) or self._failed
        return f"{type(cause).__name__}: {cause}"

    def require_compiled(self) -> None:
        """Check that this decoder's steps ran compiled: at least one bucket compiled, and no fall back to eager.

        Raises:
            RuntimeError: It fell back (the message names why), or it has compiled nothing yet.
        """
        if self.fallback_reason is not None:
            msg = f"the compiled decode step fell back to eager: {self.fallback_reason}"
            raise RuntimeError(msg)
        if not self.compile_seconds:
            msg = "no decode step has been compiled yet (more rows than the largest bucket run eager)"
            raise RuntimeError(msg)

    def step(self, ids: torch.Tensor, cache: SuffixCache) -> torch.Tensor | None:
        """One token per row: ``ids [B, 1]`` over ``cache``'s rows; logits ``[B, vocab]``, or ``None`` when
        this step cannot be compiled (too many rows, or no C++ toolchain here): the caller runs it eager.

        Raises:
            Exception: Whatever compiling or running the step raised, unless it is a toolchain failure.
        """
        rows = cache.batch_size
        bucket = batch_bucket(rows)
        if self._failed is not None or bucket is None or any(not layer.is_initialized for layer in cache.layers):
            return None
        device = self.model.device
        capacity = -(-(int(cache.lengths.max()) + 1) // CAPACITY_STEP) * CAPACITY_STEP
        cache.reserve(bucket, capacity)
        pad = bucket - rows
        lengths = torch.cat([cache.lengths, cache.lengths.new_zeros(pad)])  # padding rows write slot 0
        starts = torch.cat([cache.starts, cache.starts.new_zeros(pad)])
        context = _StaticContext(
            self.prefix,
            lengths,
            starts,
            capacity=cache.capacity,
            groups=self._groups,
            windows=self._windows,
            dtype=self.model.dtype,
            device=device,
        )
        positions = context.query_positions(1)  # [Bb, 1]
        padded_ids = torch.cat([ids, ids.new_zeros(pad, 1)])
        static = _StaticCache(cache, lengths.to(device))
        self._mark_dynamic(static, context)
        first = bucket not in self.compile_seconds
        started = time.perf_counter()
        try:
            # Each model and bucket is a graph of its own: more than dynamo's default of 8 per function.
            with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                logits = self._compiled(padded_ids.to(device), positions.to(device), static, context)
        except Exception as e:
            if toolchain_failure(e) is None:
                raise  # a bug here, in the model or in dynamo: eager steps would hide it for good
            self._failed = e  # no C++ toolchain: eager from now on, said once
            logger.warning("compiled decode step unavailable (%s); decoding eager", self.fallback_reason)
            return None
        if first:
            self.compile_seconds[bucket] = time.perf_counter() - started
        cache.advance(1)
        return logits[:rows]

    def warm_up(self, buckets: tuple[int, ...] = BATCH_BUCKETS) -> dict[int, float]:
        """Compile ``buckets`` now, each over a throwaway cache of dummy rows, so that no call pays for it;
        returns the seconds each bucket's first step took (already-compiled buckets are skipped)."""
        keys, values = self.prefix.layer(0)
        for bucket in buckets:
            if bucket in self.compile_seconds or self._failed is not None:
                continue
            cache = SuffixCache(self.prefix.pool.num_layers, bucket)
            for layer in cache.layers:  # [Bb, KVH, 1, D] of zeros: only the shapes matter
                layer.lazy_initialization(
                    keys.new_zeros(bucket, keys.shape[1], 1, keys.shape[-1]),
                    values.new_zeros(bucket, values.shape[1], 1, values.shape[-1]),
                )
            self.step(torch.zeros(bucket, 1, dtype=torch.long), cache)
        return dict(self.compile_seconds)

    def _mark_dynamic(self, static: _StaticCache, context: _StaticContext) -> None:
        """One graph for every suffix capacity and document length: those dimensions of this step's cache and
        masks are symbolic (dynamo would otherwise compile again for each; the prefix is marked once)."""
        for layer in static.layers:
            torch._dynamo.mark_dynamic(layer.keys, 2)
            torch._dynamo.mark_dynamic(layer.values, 2)
        for mask in context.suffix_masks():
            torch._dynamo.mark_dynamic(mask, 3)
        for mask in context.prefix_masks():
            torch._dynamo.mark_dynamic(mask, 3)
