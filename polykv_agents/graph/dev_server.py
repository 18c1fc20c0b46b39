"""``langgraph dev`` (LangGraph's in-memory API server) over a deployment's ``langgraph.json``, for a ``with``
block: the server the serving benchmark drives and the integration tests restart.

The config's graph paths and dependencies are made absolute, so the server can run in a folder of its own (where
the in-memory runtime keeps its threads between starts). Needs ``langgraph-cli[inmem]`` (the dev extra).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTUP_SECONDS = 300
"""How long a server may take to start (it imports the graphs; a cold model load is part of the first run)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class DevServer:
    """``langgraph dev`` on ``config``'s graphs while the block runs; :attr:`url` is where it answers.

    Args:
        config: The deployment's ``langgraph.json``.
        folder: Where the server runs and keeps its threads (kept, so a restart finds them); default a temporary
            folder, removed at the end.
        jobs: Runs the server executes at once (``--n-jobs-per-worker``).
        env: Variables set for the graphs on top of the config's ``env``.
    """

    def __init__(self, config: Path, *, folder: Path | None = None, jobs: int = 10, env: dict | None = None) -> None:
        self._temporary = tempfile.TemporaryDirectory(prefix="polykv-langgraph-") if folder is None else None
        self.folder = Path(self._temporary.name) if self._temporary is not None else folder
        spec = json.loads(config.read_text(encoding="utf-8"))
        root = config.resolve().parent  # graph paths and dependencies are relative to the config
        spec["graphs"] = {name: str(root / path.removeprefix("./")) for name, path in spec["graphs"].items()}
        spec["dependencies"] = [str(root / d) if d.startswith(".") else d for d in spec.get("dependencies", [])]
        spec["env"] = {**spec.get("env", {}), **(env or {})}
        self.config = self.folder / "langgraph.json"
        self.config.write_text(json.dumps(spec), encoding="utf-8")
        self.port, self.jobs = _free_port(), jobs
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DevServer:
        import httpx

        command = [sys.executable, "-m", "langgraph_cli", "dev", "--port", str(self.port), "--no-browser",
                   "--no-reload", "--n-jobs-per-worker", str(self.jobs), "--config", str(self.config)]  # fmt: skip
        env = {**os.environ, "LANGGRAPH_CLI_NO_ANALYTICS": "1", "LANGSMITH_TRACING": "false"}
        log_path = self.folder / "server.log"
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(command, cwd=self.folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            try:
                if httpx.get(f"{self.url}/ok", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                tail = log_path.read_text(errors="replace")[-3000:]
                msg = f"langgraph dev did not start (is langgraph-cli[inmem] installed?):\n{tail}"
                raise RuntimeError(msg)
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        # SIGINT, as Ctrl-C: the in-memory runtime writes its threads to disk on the way out.
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._temporary is not None:
            self._temporary.cleanup()
