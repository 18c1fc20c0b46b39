"""llama.cpp's own server (``llama-server``) as a peer of ``python -m benchmarks peers``: started with one
slot per parallel role, its unified KV cache and its prompt cache, and sent the pooled graph run's
exact token ids over HTTP in the graph's order, the specialists all at once, as a LangGraph graph
over an OpenAI-compatible server would send them.

Every request decodes exactly the pooled call's number of tokens (``ignore_eos``), greedily. The
server reports, per request, how many prompt tokens it actually evaluated (``timings.prompt_n``): the
evidence of what its prompt cache reused.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from benchmarks.studies.side_process import peak_rss_bytes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """A ``llama-server`` process for the length of a ``with`` block."""

    def __init__(
        self,
        binary: Path,
        model_path: Path,
        *,
        slots: int,
        ctx_per_slot: int,
        threads: int,
        flash_attn: bool,
        cache_reuse: int = 0,
        unified_kv: bool = True,
    ) -> None:
        """``cache_reuse``: the smallest chunk (tokens) of a slot's cache the server may shift into place to reuse
        it (``--cache-reuse``; 0: only a common prefix is reused). ``unified_kv``: one KV buffer shared by all
        slots (``--kv-unified``); otherwise each slot has ``ctx_per_slot`` cells of its own
        (``--no-kv-unified``)."""
        self.port = _free_port()
        self.command = [
            str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
            "--parallel", str(slots), "--kv-unified" if unified_kv else "--no-kv-unified",
            "-c", str(slots * ctx_per_slot),
            "-t", str(threads), "-tb", str(threads), "--flash-attn", "on" if flash_attn else "off",
            "--cache-prompt", "--no-webui", *(["--cache-reuse", str(cache_reuse)] if cache_reuse else []),
        ]  # fmt: skip
        self.process: subprocess.Popen | None = None
        self.log: IO[str] | None = None

    def __enter__(self) -> LlamaServer:
        # Its log goes to a file, never to a pipe: a server logs every request, and a pipe nobody reads fills and
        # blocks the server mid-request (the peers run at fcca843 stalled 13 minutes on it).
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                msg = f"llama-server exited with {self.process.returncode}: {self._log_tail()}"
                raise RuntimeError(msg)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.__exit__()
        msg = "llama-server did not become healthy within 120 s"
        raise RuntimeError(msg)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.log is not None:
            self.log.close()

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def complete(self, input_ids: Sequence[int], tokens: int, slot: int | None = None) -> dict[str, Any]:
        """One greedy completion of exactly ``tokens`` tokens; the server's JSON answer. ``slot``: the slot that
        must serve it (``id_slot``; the server holds the request until that slot is free); default: any idle
        slot, the one whose cache shares most with the prompt."""
        body = {
            "prompt": list(input_ids),
            "n_predict": tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            **({} if slot is None else {"id_slot": slot}),
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=1800) as response:
            return json.loads(response.read())


def replay_review(server: LlamaServer, calls: list[dict], slot: int | None = None) -> dict[str, Any]:
    """The review's calls stage by stage: each stage's calls sent at once (the specialists in parallel), all to
    ``slot`` if one is given (:meth:`LlamaServer.complete`)."""
    stages: dict[str, list[dict]] = {}
    for call in calls:
        stages.setdefault(call["node"], []).append(call)
    stage_s: dict[str, float] = {}
    evaluated = 0
    started = time.perf_counter()
    for node, group in stages.items():
        begun = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(group)) as pool:
            answers = list(pool.map(lambda c: server.complete(c["input_ids"], c["output_tokens"], slot), group))
        stage_s[node] = time.perf_counter() - begun
        evaluated += sum(a["timings"]["prompt_n"] for a in answers)
        if any(a["timings"]["predicted_n"] != c["output_tokens"] for a, c in zip(answers, group, strict=True)):
            msg = "llama-server decoded another number of tokens than asked; the work would not be equal"
            raise RuntimeError(msg)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "stage_s": stage_s,
        "calls": len(calls),
        "output_tokens": sum(c["output_tokens"] for c in calls),
        "prompt_tokens_evaluated": evaluated,
        "prompt_tokens": sum(len(c["input_ids"]) for c in calls),
    }


def warm_slots(server: LlamaServer, document_ids: Sequence[int], slots: int) -> None:
    """Put the document into every slot: ``slots`` one-token requests of it sent at once, so each idle slot
    takes one (a slot is busy while it evaluates the document) and keeps it in its prompt cache."""
    with ThreadPoolExecutor(max_workers=slots) as pool:
        list(pool.map(lambda _: server.complete(document_ids, 1), range(slots)))


def aggregate_decode(server: LlamaServer, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """Tokens per second of ``len(prompts)`` completions at once, and the prompt tokens the server evaluated
    for them; call :func:`warm_slots` first, so every slot already holds the document and each completion
    evaluates only its own question."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        answers = list(pool.map(lambda ids: server.complete(ids, tokens), prompts))
    seconds = time.perf_counter() - started
    return {
        "decode_tok_s_15": sum(a["timings"]["predicted_n"] for a in answers) / seconds,
        "aggregate_prompt_tokens_evaluated": sum(a["timings"]["prompt_n"] for a in answers),
    }


def server_peak_rss_bytes(server: LlamaServer) -> int:
    """The server process's peak RSS since it started (``VmHWM``, the measure of every other method)."""
    return peak_rss_bytes(server.process.pid)
