"""The llama-server wrapper keeps a chatty server running: its log never fills a pipe that nobody reads."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.studies.llama_server import LlamaServer

FAKE_SERVER = """
import http.server, sys
sys.stderr.write("x" * 1_000_000)  # a long log (a real server logs every request): far past a pipe's 64 KiB
sys.stderr.flush()
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_server_that_logs_a_lot_still_answers(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    server = LlamaServer(binary, Path("m.gguf"), slots=2, ctx_per_slot=64, threads=1, flash_attn=True, cache_reuse=256)
    assert server.command[-2:] == ["--cache-reuse", "256"]
    with server:  # healthy: it got past its log (with a pipe it blocks at 64 KiB and never serves)
        assert server.process.poll() is None
