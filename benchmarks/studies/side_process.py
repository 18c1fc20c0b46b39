"""A benchmark's other half, run in a fresh process: a request JSON file in, a result JSON file out.

    python SCRIPT REQUEST.json RESULT.json

Used where a measurement must not share the benchmark's process: llama.cpp (its peak RSS is its own),
the reference code's environment, and the OpenMP team measurement (the slow-down it shows lasts for the
life of a process). The scripts are files of the repository's ``benchmarks`` package, which is not installed:
the child finds it through ``PYTHONPATH`` (a script's own path starts at its folder, not at the repository).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]
"""The folder that holds the ``benchmarks`` package."""


class SideProcessError(RuntimeError):
    """The side process exited with an error; ``stderr`` holds what it printed."""

    def __init__(self, what: str, returncode: int, stderr: str) -> None:
        super().__init__(f"{what} failed (exit {returncode}): {stderr[-2000:]}")
        self.returncode = returncode
        self.stderr = stderr


def run_side(
    script: Path,
    request: dict[str, Any],
    *,
    what: str,
    timeout_s: float,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``python script REQUEST.json RESULT.json`` on ``request``; the result it wrote. ``env``: variables
    set in the child on top of this process's environment (and ``PYTHONPATH``, which starts at the repository).

    Raises:
        SideProcessError: The process exited with an error (``what`` names it in the message).
        subprocess.TimeoutExpired: It ran past ``timeout_s``.
    """
    child = {**os.environ, **(env or {})}
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), child.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as folder:
        request_path, result_path = Path(folder, "request.json"), Path(folder, "result.json")
        request_path.write_text(json.dumps(request))
        done = subprocess.run(
            [python, str(script), str(request_path), str(result_path)],
            capture_output=True, text=True, timeout=timeout_s, check=False,
            env=child,
        )  # fmt: skip
        if done.returncode != 0:
            raise SideProcessError(what, done.returncode, done.stderr)
        return json.loads(result_path.read_text())


def run_side_kept(script: Path, request: dict[str, Any], *, keep_in: Path | None, **kwargs: Any) -> dict[str, Any]:
    """:func:`run_side`, its result kept in the folder ``keep_in`` (``None``: kept nowhere), so that a long study
    stopped part way (a session's end, a crash) starts again where it stopped: a side process that finished before,
    with the same script, request and commit, is not run again. A checkout with uncommitted changes keeps nothing:
    its results could not name the code that made them."""
    from polykv_agents.bench.provenance import source_commit

    source = source_commit()
    if keep_in is None or source is None or source.dirty:
        return run_side(script, request, **kwargs)
    key = hashlib.sha256(json.dumps([script.name, source.commit, request], sort_keys=True).encode()).hexdigest()
    kept = keep_in / f"{script.stem}-{key[:16]}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    result = run_side(script, request, **kwargs)
    keep_in.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(result))
    return result


def _status_kib(field: str, pid: int | None = None) -> int:
    for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    msg = f"no {field} in /proc/self/status: process memory is measured on Linux only"
    raise RuntimeError(msg)


def peak_rss_bytes(pid: int | None = None) -> int:
    """The peak RSS of process ``pid`` (this one by default) since it started (``VmHWM``: unlike
    ``ru_maxrss``, it does not carry over the parent's peak across ``fork`` and ``exec``). Standard library
    only: llama.cpp's side imports no torch."""
    return _status_kib("VmHWM", pid) * 1024


def rss_bytes(pid: int | None = None) -> int:
    """The resident set of process ``pid`` (this one by default) now (``VmRSS``)."""
    return _status_kib("VmRSS", pid) * 1024
