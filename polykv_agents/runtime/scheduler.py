"""Batched decoding of concurrent agents over one shared prefix.

Requests arrive from any thread (LangGraph ``Send`` branches, ``batch``/``abatch``, plain
threads). One worker thread per (model, pool, residency) waits for them and hands each step to the
process's compute thread (:mod:`polykv_agents.model.compute_thread`), which runs the forward passes:

  loop:
    admit new requests: prefill their prompts together on top of the shared prefix (left-padded
      rows of a new SuffixCache, cascade attention), sample each first token, append the rows.
      While other rows are decoding, an admission goes in chunks of about ``admission_chunk_tokens``
      prompt tokens, one chunk per step, so running agents wait one chunk, never a whole prompt
    drop rows that finished or were cancelled
    one decode step for the whole batch: last tokens ``[B, 1]`` at positions ``T + lengths``,
      cascade attention (prefix read once for all rows), each row sampled with its own settings

Each request owns its sampling settings, token budget and generator; stop strings are applied by
the consumer on text, which then closes its iterator, which cancels the request: the row is freed
at the next step boundary while the others go on.

A scheduler holds its pool's decoded prefix and a thread. One that has had no work for
``idle_seconds`` retires: it leaves its :class:`~polykv_agents.runtime.scheduler_table.SchedulerTable`
and its thread ends, so a long-lived server that reads many pools over time keeps only the recently
used ones alive. The next request over that pool starts a fresh scheduler (its cost: decoding the
prefix once more).

This file is the loop, the client side (submit, close) and the decode step; its collaborators each know one job:

  :mod:`.scheduled_request`  one call's row: its queue of tokens, cancellation, sampling state
  :mod:`.admission`          which waiting requests join, their left-padded prompts, the next chunk, who joins
  :mod:`.packed_step`        the flat inputs and cascade of a step that packs a decode step with a chunk
  :mod:`.reuse`              the stored start a new call loads, and what a row that ends leaves for later calls
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.model.compat import cache_keyword
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.admission import ADMISSION_CHUNK_TOKENS, Admission, take_waiting
from polykv_agents.runtime.block_store import BlockStore
from polykv_agents.runtime.cascade_attention import CascadeContext, enable_cascade_attention
from polykv_agents.runtime.compiled_decode import BATCH_BUCKETS, CompiledDecoder
from polykv_agents.runtime.model_steps import ModelSteps, SharedPart
from polykv_agents.runtime.packed_step import PackedCascade, StepPart, pack_parts
from polykv_agents.runtime.prefix_tree import PrefixTrees
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.reuse import CallReuse
from polykv_agents.runtime.scheduled_request import ScheduledRequest
from polykv_agents.runtime.shared_prefix import Residency, SharedPrefix
from polykv_agents.runtime.suffix_cache import SuffixCache
from polykv_agents.sampling.grammar import TokenConstraint
from polykv_agents.sampling.settings import choose_token, eos_token_ids, repetition_history

__all__ = [
    "ADMISSION_CHUNK_TOKENS",  # defined in .admission; imported from here by the benchmarks
    "DECODE_STEP_LABEL",
    "PACKED_STEP_LABEL",
    "SCHEDULER_IDLE_SECONDS",
    "BatchScheduler",
]

logger = logging.getLogger(__name__)

DECODE_STEP_LABEL = "polykv::decode_step"
"""The ``torch.profiler`` range of one batched decode step (forward and sampling of every running row)."""

PACKED_STEP_LABEL = "polykv::packed_step"
"""The ``torch.profiler`` range of a step that also prefills an admission's chunk (see ``runtime/packed_step.py``)."""

SCHEDULER_IDLE_SECONDS = 15.0
"""How long a scheduler in a scheduler table waits without work before it retires (by default)."""


class BatchScheduler:
    """Gathers concurrent requests over one pool into one batched forward pass per step.

    Args:
        model: The model (switched to cascade attention; ordinary calls keep its own attention).
        tokenizer: Its tokenizer (for EOS ids and grammars).
        pool: The shared document pool.
        residency: Whether the prefix is kept decoded (fast) or compressed (smallest).
        max_batch_size: Rows decoded together; further requests wait for a free row.
        on_idle: Called from the worker after ``idle_seconds`` without work; returns whether the
            scheduler retired (then its thread ends). ``None``: it waits for work until closed.
        idle_seconds: Seconds without work before ``on_idle`` is asked.
        admission_chunk_tokens: Prompt tokens (over all rows being admitted) prefilled per step while other
            rows decode; ``None``: every admission in one forward, however long it makes the running rows wait.
        compile_decode: Run decode steps through ``torch.compile``
            (:class:`~polykv_agents.runtime.compiled_decode.CompiledDecoder`; a decoded prefix only): ``True`` with
            Inductor, or the name of another ``torch.compile`` backend. The first
            step of each batch-size bucket compiles (tens of seconds for a 30-layer model on 2 cores, less
            from torch's compile cache); where Inductor finds no working C++ toolchain, steps run eager and
            ``compiled.fallback_reason`` says why; any other failure reaches the step's rows.
        prefixes: Where finished calls leave their tokens' keys and values (in this pool's tree), and where a new
            call looks for the longest stored start of its prompt, prefilling only the rest (exact reuse;
            ``None``: none).
        pack_admissions: While rows decode, run their decode step and the admission's next chunk as one forward
            (:mod:`~polykv_agents.runtime.packed_step`); ``False``: two forwards per step. An admission that goes
            in whole (``admission_chunk_tokens=None``) keeps a forward of its own: packing it gained nothing
            measurable (``python -m benchmarks admission``).
        steps: Where this scheduler's steps run, shared with the other schedulers (pools) of the same model, so
            that one forward serves them all (:class:`~polykv_agents.runtime.model_steps.ModelSteps`; a
            :class:`~polykv_agents.runtime.scheduler_table.SchedulerTable` gives one per model). ``None``: steps
            of its own.
    """

    idle_seconds: float | None = SCHEDULER_IDLE_SECONDS
    """Seconds without work before ``on_idle`` is asked; ``None``: never (benchmarks that read peaks)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        pool: SharedKVPool,
        *,
        residency: Residency = "decompressed",
        max_batch_size: int = 32,
        on_idle: Callable[[BatchScheduler], bool] | None = None,
        idle_seconds: float | None = SCHEDULER_IDLE_SECONDS,
        admission_chunk_tokens: int | None = ADMISSION_CHUNK_TOKENS,
        compile_decode: bool | str | Callable = False,
        prefixes: PrefixTrees | None = None,
        pack_admissions: bool = True,
        blocks: BlockStore | None = None,
        steps: ModelSteps | None = None,
    ) -> None:
        if admission_chunk_tokens is not None and admission_chunk_tokens < 1:
            msg = f"admission_chunk_tokens must be at least 1 or None, got {admission_chunk_tokens}"
            raise ValueError(msg)
        enable_cascade_attention(model)
        self.idle_seconds = idle_seconds
        self.model = model
        self.prefix = run_on_compute_thread(SharedPrefix, pool, model, residency)
        self.max_batch_size = max_batch_size
        self.admission_chunk_tokens = admission_chunk_tokens
        self.pack_admissions = pack_admissions
        self._reuse = CallReuse(model, self.prefix, prefixes, blocks)
        self._admission: Admission | None = None  # the one admission under way, if any
        self.compiled: CompiledDecoder | None = None
        if compile_decode is not False and residency == "decompressed":
            backend = "inductor" if compile_decode is True else compile_decode
            self.compiled = CompiledDecoder(model, self.prefix, backend=backend)
        self._tokenizer = tokenizer
        self._eos_ids = eos_token_ids(model, tokenizer)
        self._num_layers = pool.num_layers
        self._inbox: queue.SimpleQueue[ScheduledRequest] = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._rows: list[ScheduledRequest] = []
        self._cache = SuffixCache(self._num_layers, 0)
        self._closed = False
        self._on_idle = on_idle
        self.peak_batch_size = 0
        self.peak_suffix_nbytes = 0
        self._steps = steps if steps is not None else ModelSteps()
        self._steps.join(self)
        self._thread = threading.Thread(target=self._run, name="polykv-scheduler", daemon=True)
        self._thread.start()

    @property
    def prefixes(self) -> PrefixTrees | None:
        """Where finished calls leave their keys and values and new calls find their stored starts (or ``None``)."""
        return self._reuse.prefixes

    @property
    def blocks(self) -> BlockStore | None:
        """The same, for calls that read it at other positions (``reuse="blocks"``), or ``None``."""
        return self._reuse.blocks

    # ---------------------------------------------------------------- client side

    def submit(self, request: DecodeRequest, budget: int, constraint: TokenConstraint | None = None) -> Iterator[int]:
        """Queue ``request`` (at most ``budget`` tokens); returns an iterator of its token ids. Closing the
        iterator cancels it.

        ``constraint`` is the request's grammar state (:func:`polykv_agents.sampling.settings.token_constraint`),
        built by the caller, outside any lock: compiling a grammar can take a while.
        """
        settings = request.settings
        self._reuse.check(settings)  # before any work
        row = ScheduledRequest(
            request.prompt_ids, settings, budget, request.stats, settings.make_generator(), constraint
        )
        row.history = repetition_history(settings, request.prompt_ids)
        row.tokens = request.prompt_ids.tolist()
        with self._wake:
            if self._closed:
                msg = "this scheduler is closed; submit through a SchedulerTable (an Engine's), which starts a new one"
                raise RuntimeError(msg)
            self._inbox.put(row)
            self._wake.notify()
        return row.stream()

    # ---------------------------------------------------------------- worker side

    def close(self) -> None:
        """Stop the worker thread after its current step (requests still queued are ended)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def close_if_idle(self) -> bool:
        """Close now if no request is running or waiting; returns whether it closed."""
        with self._wake:
            if self._rows or self._admission is not None or not self._inbox.empty():
                return False
            self._closed = True
            self._wake.notify()  # a worker waiting for work ends now, and its decoded prefix goes with it
            return True

    def warm_up(self, buckets: tuple[int, ...] | None = None) -> dict[int, float]:
        """Compile the decode step for ``buckets`` of rows now (default: every bucket), on the compute thread, so
        that no call pays for it; the seconds each bucket took. Nothing to do (``{}``) without ``compile_decode``."""
        if self.compiled is None:
            return {}
        chosen = BATCH_BUCKETS if buckets is None else buckets
        return run_on_compute_thread(self.compiled.warm_up, tuple(b for b in chosen if b <= self.max_batch_size))

    def _wait_for_work(self) -> bool:
        """Block until there is work; ``False`` once closed or retired."""
        while True:
            with self._wake:
                while not self._busy() and self._inbox.empty() and not self._closed:
                    timeout = self.idle_seconds if self._on_idle is not None else None
                    # Re-read after the wait: idle_seconds may have been set to None meanwhile.
                    if not self._wake.wait(timeout) and self._inbox.empty() and self.idle_seconds is not None:
                        break  # idle for idle_seconds
                if self._closed:
                    return False
                if self._busy() or not self._inbox.empty():
                    return True
            # Outside the condition: on_idle takes the registry lock first, as submit() does.
            if self._on_idle is not None and self._on_idle(self):
                return False

    def _busy(self) -> bool:
        """Whether rows are decoding or an admission is under way."""
        return bool(self._rows) or self._admission is not None

    @property
    def busy(self) -> bool:
        """Whether it has work for a step: rows decoding, an admission under way or requests waiting (its worker
        comes for a step at once)."""
        return self._busy() or not self._inbox.empty()

    def _run(self) -> None:
        try:
            while self._wait_for_work():
                # The tensor work of a step runs on the process's one compute thread (see
                # polykv_agents.model.compute_thread), in one forward with the model's other pools' steps
                # (ModelSteps); this thread only waits for work and hands it over.
                self._steps.step(self)
        finally:
            self._steps.leave(self)
        admitting = self._admission.requests if self._admission is not None else []
        for request in [*self._rows, *admitting]:
            request.finish("stop")
        while not self._inbox.empty():
            self._inbox.get_nowait().finish("stop")

    def run_step(self) -> None:
        """This pool's step alone, on the compute thread (:class:`~.model_steps.ModelSteps` calls it)."""
        self._step()

    def _step(self) -> None:
        """Admit waiting requests, then one decode step for every running row: one forward for both when an
        admission goes in chunks while rows decode and ``pack_admissions`` is on (see :mod:`.packed_step`)."""
        try:
            self._drop_finished()  # rows cancelled since the last step: before they cost a packed forward a token
            if self._admission is None:
                self._admission = self._start_admission()
            if self._admission is not None and self._rows and self.pack_admissions and self.admission_chunk_tokens:
                self._packed_step()
            else:
                self._admit()
                self._drop_finished()
                if self._rows:
                    self._decode_step()
            self._drop_finished()
        except Exception as e:  # a failed forward must not hang the callers
            self._fail_rows(e)

    def _fail_rows(self, error: BaseException) -> None:
        """End every running row with ``error`` (raised to its consumer) after a failed step."""
        logger.error("batched decode step failed", exc_info=error)
        for request in self._rows:
            request.fail(error)
        self._rows, self._cache = [], SuffixCache(self._num_layers, 0)

    def fail_step(self, error: BaseException) -> None:
        """End every call this pool holds (running rows, the admission under way, calls waiting for one) with
        ``error``: a step failed where nothing tells which of its calls it came from. Waiting calls end too, so a
        step that fails every time cannot keep them waiting for ever."""
        self._fail_rows(error)
        if self._admission is not None:
            self._fail_admission(error)
        while not self._inbox.empty():
            self._inbox.get_nowait().fail(error)

    # ---------------------------------------------------------------- a step shared with other pools

    @property
    def running_rows(self) -> int:
        """Rows decoding now."""
        return len(self._rows)

    @property
    def has_admission_work(self) -> bool:
        """Whether an admission is under way or requests wait for one."""
        return self._admission is not None or not self._inbox.empty()

    def shared_part(self, others_decoding: bool, admitting_pools: int) -> SharedPart | None:
        """This pool's work in a step other pools share: its running rows (one token each) and its admission's next
        chunk, as packed parts; ``None`` when it has none. Nothing is committed before :meth:`finish_shared_part`.
        ``others_decoding``: whether any pool of the step has running rows (then an admission goes in chunks);
        ``admitting_pools``: how many pools of the step admit, who share the chunk budget."""
        try:
            self._drop_finished()
            if self._admission is None:
                self._admission = self._start_admission()
            parts, columns = [], 0
            if self._rows:
                last = torch.tensor([[r.last_token] for r in self._rows])  # [B, 1]
                parts.append(StepPart(last, self._cache, self._context(self._cache)))
            admission = self._admission
            if admission is not None:
                budget = self.admission_chunk_tokens
                if budget is not None:
                    budget = max(1, budget // max(1, admitting_pools))
                columns = admission.next_columns(bool(self._rows) or others_decoding, budget)
                parts.append(StepPart(admission.chunk(columns), admission.rows, self._context(admission.rows)))
        except Exception as e:  # as in a step of its own: this pool's calls end with the error, the others go on
            self.fail_step(e)
            return None
        return SharedPart(self, parts, len(self._rows), columns) if parts else None

    def packed_logits(self, ids, positions, packed: PackedCascade, keep: torch.Tensor) -> torch.Tensor:
        """Logits ``[kept, vocab]`` of a packed forward (any pools' parts; the model is this scheduler's)."""
        return self._model_logits(ids, positions, packed.cache, packed, keep.to(self.model.device))[0]

    def finish_shared_part(self, part: SharedPart, logits: torch.Tensor) -> None:
        """Commit this pool's part of a shared step and sample: ``logits [rows, vocab]``, each running row's next
        token, then each admitted row's last token of the chunk."""
        try:
            nbytes = 0
            if part.running:
                self._cache.advance(1)
                nbytes += self._cache.nbytes
                for row, request in enumerate(self._rows):
                    self._emit(request, logits[row])
            if part.columns:
                admission = self._admission
                admission.rows.advance(part.columns)
                admission.done += part.columns
                nbytes += admission.rows.nbytes
                if admission.complete:
                    self._finish_admission(logits[part.running :])
            self.peak_suffix_nbytes = max(self.peak_suffix_nbytes, nbytes)
            self._drop_finished()
        except Exception as e:
            self._fail_rows(e)

    def _emit(self, request: ScheduledRequest, logits: torch.Tensor) -> None:
        """Sample one token for ``request`` and deliver it, or finish the request."""
        try:
            token, reason = choose_token(
                logits,
                request.settings,
                request.generator,
                request.constraint,
                self._eos_ids,
                request.history,
                request.stats.logprobs,  # appended before the token is queued: its consumer reads it after
                request.budget - request.produced,
            )
            if request.constraint is not None and request.constraint.closing:
                request.stats.grammar_closed = True
        except Exception as e:  # this request's grammar (or sampling) failed: only this row ends
            request.fail(e)
            return
        if token is not None:
            request.produced += 1
            request.last_token = token
            request.tokens.append(token)
            request.out.put(token)
        if reason is not None:
            request.finish(reason)
        elif request.produced >= request.budget:
            request.finish("length")

    def _forward(self, ids: torch.Tensor, cache: SuffixCache) -> torch.Tensor:
        """Forward ``ids [B, q]`` for the rows of ``cache``; returns last-position logits ``[B, vocab]``."""
        q_len = ids.shape[-1]
        context = self._context(cache)
        # Row r's token in slot j sits at position T + j - starts[r]; left padding gets clamped positions.
        positions = context.query_positions(q_len).clamp(min=0)  # [B, q]
        logits = self._model_logits(ids, positions, cache, context, 1)
        cache.advance(q_len)
        return logits[:, -1]

    def _model_logits(self, ids, positions, cache, cascade, logits_to_keep) -> torch.Tensor:
        """The model's logits for ``ids`` at ``positions`` over ``cache`` with cascade attention (``cascade``)."""
        device = self.model.device
        with torch.inference_mode():
            return self.model(
                input_ids=ids.to(device),
                position_ids=positions.to(device),
                use_cache=True,
                **{cache_keyword(self.model): cache},
                logits_to_keep=logits_to_keep,
                cascade=cascade,
            ).logits

    def _context(self, cache: SuffixCache) -> CascadeContext:
        """The cascade context of one forward over ``cache``'s rows (their lengths as they are before it)."""
        return CascadeContext(self.prefix, cache.lengths.clone(), cache.starts.clone())

    def _admit(self) -> None:
        """Start admitting the waiting requests (up to the free rows) if no admission is under way, then
        prefill the next chunk of the one that is (:meth:`.Admission.next_columns`). When its last chunk is in,
        each admitted request gets its first token and joins the running rows."""
        if self._admission is None:
            self._admission = self._start_admission()
            if self._admission is None:
                return
        admission = self._admission
        columns = admission.next_columns(bool(self._rows), self.admission_chunk_tokens)
        try:
            logits = self._forward(admission.chunk(columns), admission.rows)
        except Exception as e:  # these prompts failed; the running batch is untouched
            self._fail_admission(e)
            return
        admission.done += columns
        if admission.complete:
            self._finish_admission(logits)

    def _start_admission(self) -> Admission | None:
        """The waiting requests that fit in the free rows, with the starts earlier calls stored for them."""
        waiting = take_waiting(self._inbox, self.max_batch_size - len(self._rows))
        if not waiting:
            return None
        try:
            return Admission.prepare(waiting, [self._reuse.start(request) for request in waiting], self._num_layers)
        except Exception as e:  # taken from the inbox, these calls are nobody else's: they end with the error
            logger.error("admission failed", exc_info=e)
            for request in waiting:
                request.fail(e)
            return None

    def _fail_admission(self, error: BaseException) -> None:
        """End every request of the admission under way with ``error``."""
        admission, self._admission = self._admission, None
        admission.fail(error)

    def _finish_admission(self, logits: torch.Tensor) -> None:
        """The admission's last chunk is in (``logits [A, vocab]`` at each row's last prompt token): each
        request gets its first token, and those still going join the running rows."""
        admission, self._admission = self._admission, None
        joining = admission.finish(logits, self._emit, self._reuse.remember)
        if joining:
            self._rows += joining
            self._cache.concat(admission.rows)  # [B, ...] + [A', ...]: the rows that left are gone from it
        self.peak_batch_size = max(self.peak_batch_size, len(self._rows))

    def _packed_step(self) -> None:
        """The running rows' decode step and the admission's next chunk in one forward (:mod:`.packed_step`): this
        pool's part of a shared step (:meth:`shared_part`), run alone."""
        part = self.shared_part(others_decoding=False, admitting_pools=1)
        with torch.profiler.record_function(PACKED_STEP_LABEL):
            packed, ids, positions = pack_parts(part.parts)
            try:
                # [B + A, vocab]: each running row's next token, then each admitted row's last
                logits = self.packed_logits(ids, positions, packed, packed.kept_positions())
            except Exception as e:  # which rows' inputs failed is unknown: both groups end with the error
                self._fail_admission(e)
                raise
            self.finish_shared_part(part, logits)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.stats.finish_reason is None and not r.cancelled.is_set()]
        if len(keep) == len(self._rows):
            return
        for i, request in enumerate(self._rows):
            if i not in keep and request.stats.finish_reason is None:
                request.finish("stop")  # cancelled by its consumer
            if i not in keep:
                self._reuse.remember(request, self._cache, i)
        self._rows = [self._rows[i] for i in keep]
        self._cache.select(torch.tensor(keep, dtype=torch.long))

    def _decode_step(self) -> None:
        # Labelled for torch.profiler (python -m benchmarks profile); the label costs about a microsecond unprofiled.
        with torch.profiler.record_function(DECODE_STEP_LABEL):
            ids = torch.tensor([[r.last_token] for r in self._rows])  # [B, 1]
            logits = self.compiled.step(ids, self._cache) if self.compiled is not None else None
            if logits is None:
                logits = self._forward(ids, self._cache)
            self.peak_suffix_nbytes = max(self.peak_suffix_nbytes, self._cache.nbytes)
            for row, request in enumerate(self._rows):
                self._emit(request, logits[row])
