"""Run a blocking iterator on a worker thread and consume it from asyncio without blocking the loop.

The producer thread pushes items into an ``asyncio.Queue`` through ``call_soon_threadsafe``. If the
consumer stops early (cancelled task, ``break``), a flag tells the producer to close its iterator
between items, so the iterator's ``finally`` blocks run (for decoding: the call's cache is freed and
the request's slot given back) while the other requests go on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Yield the items of ``make_iterator()``, which is created and consumed on its own thread."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    cancelled = threading.Event()

    def put(item: object) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def produce() -> None:
        try:
            iterator = make_iterator()
            try:
                for item in iterator:
                    if cancelled.is_set():
                        break
                    put(item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as e:  # handed to the consumer, re-raised there
            put(e)
        finally:
            put(_DONE)

    thread = threading.Thread(target=produce, name="polykv-decode", daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        cancelled.set()
