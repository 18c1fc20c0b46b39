"""Backpressure: how many calls an engine serves at once (decoding or waiting for a row), over all its pools.

Every call holds a row of a suffix cache while it decodes, and a place in a queue before: memory that grows with
the calls in flight. A server that accepts whatever arrives runs out of memory under load; one with a limit makes
the caller wait for a free place, up to ``wait_seconds``, then refuses the call with :class:`EngineBusyError`,
which says what to raise. A call's place is freed when its tokens end, fail, or its consumer closes them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

DEFAULT_MAX_CALLS = 256
"""Calls an engine serves at once by default: 8 LangGraph runs of 15 parallel roles need 120."""

DEFAULT_WAIT_SECONDS = 300.0
"""How long a call waits for a free place by default before it is refused."""


class EngineBusyError(RuntimeError):
    """The engine was serving its ``max_calls`` calls and none ended within the call's wait."""


class CallLimit:
    """At most ``max_calls`` calls at once (``None``: no limit); a call waits up to ``wait_seconds`` for a place."""

    def __init__(self, max_calls: int | None = DEFAULT_MAX_CALLS, wait_seconds: float = DEFAULT_WAIT_SECONDS) -> None:
        if max_calls is not None and max_calls < 1:
            msg = f"max_calls must be at least 1 (or None for no limit), got {max_calls}"
            raise ValueError(msg)
        self.max_calls, self.wait_seconds = max_calls, wait_seconds
        self._places = threading.BoundedSemaphore(max_calls) if max_calls is not None else None

    def admit(self) -> None:
        """Take a place for one call, waiting up to :attr:`wait_seconds`.

        Raises:
            EngineBusyError: No place became free in time.
        """
        if self._places is not None and not self._places.acquire(timeout=self.wait_seconds):
            msg = (
                f"the engine is serving {self.max_calls} calls (its max_calls) and none ended within "
                f"{self.wait_seconds:g} s; send fewer calls at once, or raise Engine(max_calls=..., "
                "call_wait_seconds=...) if the machine has the memory for more"
            )
            raise EngineBusyError(msg)

    def release(self) -> None:
        if self._places is not None:
            self._places.release()

    def holding(self, tokens: Iterator[int]) -> Iterator[int]:
        """``tokens``, holding the call's place until they end, fail, or are closed (or dropped)."""
        return _HeldTokens(tokens, self.release) if self._places is not None else tokens


class _HeldTokens:
    """An iterator of token ids that frees its call's place exactly once, however the call ends."""

    def __init__(self, tokens: Iterator[int], release) -> None:
        self._tokens, self._release = tokens, release
        self._held = True

    def __iter__(self) -> _HeldTokens:
        return self

    def __next__(self) -> int:
        try:
            return next(self._tokens)
        except BaseException:  # the end (StopIteration) or the call's error: either way its place is free
            self._free()
            raise

    def close(self) -> None:
        """Cancel the call (as closing its token stream does) and free its place."""
        try:
            close = getattr(self._tokens, "close", None)
            if close is not None:
                close()
        finally:
            self._free()

    def _free(self) -> None:
        if self._held:
            self._held = False
            self._release()

    def __del__(self) -> None:
        self.close()
