"""The llama-server wrapper keeps a chatty server running (its log never fills a pipe that nobody reads), and
sends a call to the slot it names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.studies.llama_server import LlamaServer

FAKE_SERVER = """
import http.server, json, sys
sys.stderr.write("x" * 1_000_000)  # a long log (a real server logs every request): far past a pipe's 64 KiB
sys.stderr.flush()
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):  # answers with the request it got
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"request": json.loads(body)}).encode())

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _fake_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    return binary


def test_a_server_that_logs_a_lot_still_answers(tmp_path):
    server = LlamaServer(
        _fake_binary(tmp_path), Path("m.gguf"), slots=2, ctx_per_slot=64, threads=1, flash_attn=True, cache_reuse=256
    )
    assert server.command[-2:] == ["--cache-reuse", "256"]
    with server:  # healthy: it got past its log (with a pipe it blocks at 64 KiB and never serves)
        assert server.process.poll() is None


@pytest.mark.parametrize("unified_kv", [True, False])
def test_slots_share_one_kv_cache_or_have_their_own_and_a_call_can_name_its_slot(tmp_path, unified_kv):
    server = LlamaServer(
        _fake_binary(tmp_path), Path("m.gguf"), slots=3, ctx_per_slot=64, threads=1, flash_attn=True,
        unified_kv=unified_kv,
    )  # fmt: skip
    assert ("--kv-unified" in server.command) is unified_kv and ("--no-kv-unified" in server.command) is not unified_kv
    assert server.command[server.command.index("-c") + 1] == "192"  # 3 slots of 64 cells, shared or each its own
    with server:
        pinned, free = server.complete([1, 2], 3, slot=2)["request"], server.complete([1, 2], 3)["request"]
    assert pinned["id_slot"] == 2 and "id_slot" not in free
    assert pinned["prompt"] == [1, 2] and pinned["n_predict"] == 3 and pinned["ignore_eos"] is True
