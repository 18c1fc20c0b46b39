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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.model.architecture import document_token_limit
from polykv_agents.model.compat import cache_keyword
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.model.rope import rotary_embedding
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.block_reuse import ComposedStart, compose_start
from polykv_agents.runtime.block_store import BlockStore
from polykv_agents.runtime.cascade_attention import CascadeContext, enable_cascade_attention
from polykv_agents.runtime.compiled_decode import BATCH_BUCKETS, CompiledDecoder
from polykv_agents.runtime.packed_step import PackedCascade, PackedGroup
from polykv_agents.runtime.prefix_tree import PrefixMatch, PrefixTrees
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.shared_prefix import Residency, SharedPrefix
from polykv_agents.runtime.suffix_cache import SuffixCache
from polykv_agents.sampling.grammar import TokenConstraint
from polykv_agents.sampling.settings import (
    GenerationSettings,
    GenerationStats,
    choose_token,
    eos_token_ids,
    repetition_history,
)

logger = logging.getLogger(__name__)

DECODE_STEP_LABEL = "polykv::decode_step"
"""The ``torch.profiler`` range of one batched decode step (forward and sampling of every running row)."""

PACKED_STEP_LABEL = "polykv::packed_step"
"""The ``torch.profiler`` range of a step that also prefills an admission's chunk (see ``runtime/packed_step.py``)."""

_END = object()

SCHEDULER_IDLE_SECONDS = 15.0
"""How long a scheduler in a scheduler table waits without work before it retires (by default)."""

ADMISSION_CHUNK_TOKENS = 128
"""Prompt tokens (over all rows being admitted) prefilled per step while other rows decode, by default."""


@dataclass(eq=False)
class _Request:
    prompt_ids: torch.Tensor  # [n]
    settings: GenerationSettings
    budget: int
    stats: GenerationStats
    generator: torch.Generator | None
    constraint: TokenConstraint | None = None  # this request's own grammar state, if it has a grammar
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    produced: int = 0
    last_token: int = -1
    history: set[int] | None = None  # what a repetition penalty looks at (None: no penalty)
    tokens: list[int] = field(default_factory=list)  # its prompt, then what it generated: the prefix tree's key
    exact_length: int | None = None  # its row is exact for this many tokens only (blocks moved in after); None: all

    def finish(self, reason: str) -> None:
        self.stats.finish_reason = reason  # type: ignore[assignment]
        self.out.put(_END)

    def fail(self, error: BaseException) -> None:
        """End this request with ``error`` (raised to its consumer); the other rows go on."""
        self.stats.finish_reason = "stop"
        self.out.put(error)


@dataclass(eq=False)
class _Admission:
    """Requests being admitted together: their left-padded prompts and the suffix rows prefilled so far."""

    requests: list[_Request]
    ids: torch.Tensor  # [A, width] prompts, left-padded to the longest
    rows: SuffixCache  # their suffixes: the first ``done`` columns of ids
    done: int = 0

    @property
    def width(self) -> int:
        return self.ids.shape[1]


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
            from torch's compile cache); where compiling fails, steps run eager.
        prefixes: Where finished calls leave their tokens' keys and values (in this pool's tree), and where a new
            call looks for the longest stored start of its prompt, prefilling only the rest (exact reuse;
            ``None``: none).
        pack_admissions: While rows decode, run their decode step and the admission's next chunk as one forward
            (:mod:`~polykv_agents.runtime.packed_step`); ``False``: two forwards per step. An admission that goes
            in whole (``admission_chunk_tokens=None``) keeps a forward of its own: packing it gained nothing
            measurable (``polykv-agents bench admission``).
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
    ) -> None:
        if admission_chunk_tokens is not None and admission_chunk_tokens < 1:
            msg = f"admission_chunk_tokens must be at least 1 or None, got {admission_chunk_tokens}"
            raise ValueError(msg)
        enable_cascade_attention(model)
        self.idle_seconds = idle_seconds
        self.model = model
        self.prefix = run_on_compute_thread(SharedPrefix, pool, model, residency)
        self.max_batch_size = max_batch_size
        self.prefixes = prefixes
        self.blocks = blocks
        self.admission_chunk_tokens = admission_chunk_tokens
        self.pack_admissions = pack_admissions
        self._admission: _Admission | None = None
        self.compiled: CompiledDecoder | None = None
        if compile_decode is not False and residency == "decompressed":
            backend = "inductor" if compile_decode is True else compile_decode
            self.compiled = CompiledDecoder(model, self.prefix, backend=backend)
        self._tokenizer = tokenizer
        self._eos_ids = eos_token_ids(model, tokenizer)
        self._num_layers = pool.num_layers
        self._inbox: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._wake = threading.Condition()
        self._rows: list[_Request] = []
        self._cache = SuffixCache(self._num_layers, 0)
        self._closed = False
        self._on_idle = on_idle
        self.peak_batch_size = 0
        self.peak_suffix_nbytes = 0
        self._thread = threading.Thread(target=self._run, name="polykv-scheduler", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- client side

    def submit(self, request: DecodeRequest, budget: int, constraint: TokenConstraint | None = None) -> Iterator[int]:
        """Queue ``request`` (at most ``budget`` tokens); returns an iterator of its token ids. Closing the
        iterator cancels it.

        ``constraint`` is the request's grammar state (:func:`polykv_agents.sampling.settings.token_constraint`),
        built by the caller, outside any lock: compiling a grammar can take a while.
        """
        settings = request.settings
        if settings.reuse == "blocks":
            if self.blocks is None:
                msg = (
                    "reuse='blocks' reads text that earlier calls left, and this engine keeps none; make the engine "
                    "with a budget for it, Engine(max_block_bytes=64 * 1024**2), or call with reuse='exact'"
                )
                raise ValueError(msg)
            rotary_embedding(self.model)  # a model whose keys cannot move is refused here, before any work
        row = _Request(request.prompt_ids, settings, budget, request.stats, settings.make_generator(), constraint)
        row.history = repetition_history(settings, request.prompt_ids)
        row.tokens = request.prompt_ids.tolist()
        with self._wake:
            if self._closed:
                msg = "this scheduler is closed; submit through a SchedulerTable (an Engine's), which starts a new one"
                raise RuntimeError(msg)
            self._inbox.put(row)
            self._wake.notify()
        return self._tokens(row)

    @staticmethod
    def _tokens(request: _Request) -> Iterator[int]:
        try:
            while True:
                item = request.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.cancelled.set()

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

    def _run(self) -> None:
        while self._wait_for_work():
            # The tensor work of a step runs on the process's one compute thread (see
            # polykv_agents.model.compute_thread); this thread only waits for work and hands it over.
            run_on_compute_thread(self._step)
        admitting = self._admission.requests if self._admission is not None else []
        for request in [*self._rows, *admitting]:
            request.finish("stop")
        while not self._inbox.empty():
            self._inbox.get_nowait().finish("stop")

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
            logger.exception("batched decode step failed")
            for request in self._rows:
                request.out.put(e)
            self._rows, self._cache = [], SuffixCache(self._num_layers, 0)

    def _emit(self, request: _Request, logits: torch.Tensor) -> None:
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
        prefill the next chunk of the one that is (:meth:`_chunk_columns`). When its last chunk is in, each
        admitted request gets its first token and joins the running rows."""
        if self._admission is None:
            self._admission = self._start_admission()
            if self._admission is None:
                return
        admission = self._admission
        columns = self._chunk_columns(admission)
        try:
            logits = self._forward(admission.ids[:, admission.done : admission.done + columns], admission.rows)
        except Exception as e:  # these prompts failed; the running batch is untouched
            self._fail_admission(e)
            return
        admission.done += columns
        if admission.done == admission.width:
            self._finish_admission(logits)

    def _chunk_columns(self, admission: _Admission) -> int:
        """Prompt columns of ``admission`` to prefill this step: all that are left when no other row is decoding
        (nobody waits), else about ``admission_chunk_tokens`` prompt tokens."""
        columns = admission.width - admission.done
        if self._rows and self.admission_chunk_tokens is not None:
            columns = min(columns, max(1, self.admission_chunk_tokens // len(admission.requests)))
        return columns

    def _fail_admission(self, error: BaseException) -> None:
        """End every request of the admission under way with ``error``."""
        admission, self._admission = self._admission, None
        for request in admission.requests:
            request.out.put(error)

    def _finish_admission(self, logits: torch.Tensor) -> None:
        """The admission's last chunk is in (``logits [A, vocab]`` at each row's last prompt token): each
        request gets its first token and joins the running rows."""
        admission, self._admission = self._admission, None
        keep = []
        for row, request in enumerate(admission.requests):
            if request.cancelled.is_set():  # its consumer left while its prompt was being prefilled
                request.finish("stop")
                self._remember(request, admission.rows, row)
                continue
            self._emit(request, logits[row])
            if request.stats.finish_reason is None:
                keep.append(row)
                self._rows.append(request)
            else:
                self._remember(request, admission.rows, row)
        if keep:
            admission.rows.select(torch.tensor(keep, dtype=torch.long))
            self._cache.concat(admission.rows)
        self.peak_batch_size = max(self.peak_batch_size, len(self._rows))

    def _packed_step(self) -> None:
        """The running rows' decode step and the admission's next chunk in one forward (:mod:`.packed_step`)."""
        admission = self._admission
        columns = self._chunk_columns(admission)
        running = len(self._rows)
        with torch.profiler.record_function(PACKED_STEP_LABEL):
            chunk = admission.ids[:, admission.done : admission.done + columns]  # [A, c]
            decode = PackedGroup(running, 1, self._cache, self._context(self._cache))
            admitted = PackedGroup(len(admission.requests), columns, admission.rows, self._context(admission.rows))
            packed = PackedCascade([decode, admitted])
            ids = torch.cat([torch.tensor([r.last_token for r in self._rows]), chunk.reshape(-1)])  # [B + A*c]
            chunk_positions = admitted.context.query_positions(columns).clamp(min=0)  # left padding: clamped
            positions = torch.cat([decode.context.query_positions(1).view(-1), chunk_positions.view(-1)])
            try:
                keep = packed.kept_positions().to(self.model.device)
                # [B + A, vocab]: each running row's next token, then each admitted row's last
                logits = self._model_logits(ids.view(1, -1), positions.view(1, -1), packed.cache, packed, keep)[0]
            except Exception as e:  # which rows' inputs failed is unknown: both groups end with the error
                self._fail_admission(e)
                raise
            self._cache.advance(1)
            admission.rows.advance(columns)
            admission.done += columns
            self.peak_suffix_nbytes = max(self.peak_suffix_nbytes, self._cache.nbytes + admission.rows.nbytes)
            for row, request in enumerate(self._rows):
                self._emit(request, logits[row])
        if admission.done == admission.width:
            self._finish_admission(logits[running:])

    def _start_admission(self) -> _Admission | None:
        """The waiting requests that fit in the free rows, their prompts left-padded to the longest, so each
        row's last prompt token is the last position (the padding slots are masked for good)."""
        admitted: list[_Request] = []
        while len(self._rows) + len(admitted) < self.max_batch_size:
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                break
            if request.cancelled.is_set():
                request.finish("stop")
            elif request.budget == 0:
                request.finish("length")
            else:
                request.stats.started_at = time.monotonic()
                admitted.append(request)
        if not admitted:
            return None
        matches = [self._composed_start(request, self._stored_start(request)) for request in admitted]
        # Every row's last prompt token must land in the last column. The width is the longest part still to
        # prefill; a row with less to prefill reads fewer stored tokens and prefills more of its own instead of
        # padding: the same columns are computed either way.
        width = max(r.prompt_ids.numel() - m.length for r, m in zip(admitted, matches, strict=True))
        reused = [max(0, min(m.length, r.prompt_ids.numel() - width)) for r, m in zip(admitted, matches, strict=True)]
        ids = torch.zeros(len(admitted), width, dtype=torch.long)
        rows = SuffixCache(self._num_layers, len(admitted), capacity=max(reused) + width)
        for row, (request, match, stored) in enumerate(zip(admitted, matches, reused, strict=True)):
            n = request.prompt_ids.numel()
            pad = max(0, width - n)
            ids[row, pad:] = request.prompt_ids[stored:]  # [n - stored] = [width - pad]
            rows.starts[row] = pad
            if stored:
                rows.load_row(row, [match.layer(i, stored) for i in range(self._num_layers)])
            request.stats.reused_tokens = stored
            request.stats.evicted_tokens = min(match.evicted_tokens, n - 1 - stored)
            if isinstance(match, ComposedStart):  # part of its start was computed in composing: not reused
                request.stats.reused_tokens = match.reused_before(stored)
                request.stats.block_tokens = match.moved_before(stored)
                # Never stored as exact past its first moved block, even all recomputed: the tree holds prefills only.
                request.exact_length = match.exact_length if match.exact_length < stored else None
        return _Admission(admitted, ids, rows)

    def _stored_start(self, request: _Request) -> PrefixMatch:
        """The longest start of ``request``'s prompt stored by earlier calls (never all of it: its last token
        must run through the model for the first token's logits)."""
        if self.prefixes is None:
            return PrefixMatch()
        return self.prefixes.match(self.model, self.prefix.pool.digest, request.tokens, request.prompt_ids.numel() - 1)

    def _composed_start(self, request: _Request, match: PrefixMatch) -> PrefixMatch | ComposedStart:
        """``match``, extended by blocks moved from earlier calls (``reuse="blocks"``) when its prompt holds any
        after it (:mod:`.block_reuse`); ``match`` as it is otherwise."""
        if self.blocks is None or request.settings.reuse != "blocks":
            return match
        last = request.prompt_ids.numel() - 1  # the last prompt token runs through the model: never moved
        limit = document_token_limit(self.model)
        if limit is not None:  # a sliding window must hold the composed start whole (the pool is held whole)
            last = min(last, limit - self.prefix.num_tokens)
        digest = self.prefix.pool.digest
        occurrences = self.blocks.find(self.model, digest, request.tokens, match.length, last)
        if not occurrences:
            return match
        tokens = request.tokens[: occurrences[-1].start + occurrences[-1].length]
        try:
            return compose_start(self.model, self.prefix, match, tokens, occurrences, request.settings.block_recompute)
        except Exception:  # composing is an optimisation: the call prefills instead, which is never wrong
            logger.exception("composing moved blocks failed; the call prefills its prompt instead")
            return match

    def _remember(self, request: _Request, cache: SuffixCache, row: int) -> None:
        """Store what row ``row`` of ``cache`` ran through the model (``request``'s prompt and the tokens it
        generated, but for the last one, which no forward has read yet) for later calls to reuse: in the prefix
        tree and as a block, its exact part only (never keys and values composed from moved blocks)."""
        if self.prefixes is None and self.blocks is None:
            return
        start, end = int(cache.starts[row]), int(cache.lengths[row])
        if request.exact_length is not None:
            end = min(end, start + request.exact_length)
        if end <= start or not cache.layers[0].is_initialized:
            return
        layers = [(layer.keys[row, :, start:end], layer.values[row, :, start:end]) for layer in cache.layers]
        tokens = request.tokens[: end - start]
        if self.prefixes is not None:
            self.prefixes.insert(self.model, self.prefix.pool.digest, tokens, layers)
        if self.blocks is not None:
            self.blocks.add(self.model, self.prefix.pool.digest, tokens, layers)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.stats.finish_reason is None and not r.cancelled.is_set()]
        if len(keep) == len(self._rows):
            return
        for i, request in enumerate(self._rows):
            if i not in keep and request.stats.finish_reason is None:
                request.finish("stop")  # cancelled by its consumer
            if i not in keep:
                self._remember(request, self._cache, i)
        self._rows = [self._rows[i] for i in keep]
        self._cache.select(torch.tensor(keep, dtype=torch.long))

    def _decode_step(self) -> None:
        # Labelled for torch.profiler (polykv-agents bench profile); the label costs about a microsecond unprofiled.
        with torch.profiler.record_function(DECODE_STEP_LABEL):
            ids = torch.tensor([[r.last_token] for r in self._rows])  # [B, 1]
            logits = self.compiled.step(ids, self._cache) if self.compiled is not None else None
            if logits is None:
                logits = self._forward(ids, self._cache)
            self.peak_suffix_nbytes = max(self.peak_suffix_nbytes, self._cache.nbytes)
            for row, request in enumerate(self._rows):
                self._emit(request, logits[row])
