"""Peak resident memory of this process over a block of code, sampled from the OS."""

from __future__ import annotations

import threading


class PeakRss:
    """Samples the RSS of this process (or of process ``pid``) every ``interval_s`` while the block runs;
    ``peak_bytes`` after.

    ``ru_maxrss`` only ever grows over the whole process, so it cannot tell one measurement of a suite
    from the previous one; sampling can.

        with PeakRss() as rss:
            run_agents()
        rss.peak_bytes
    """

    def __init__(self, interval_s: float = 0.005, *, pid: int | None = None) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        import psutil  # the bench extra: imported where used, so the CLI starts without it

        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRss:
        self._sample()
        self._thread = threading.Thread(target=self._run, name="polykv-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._sample()
