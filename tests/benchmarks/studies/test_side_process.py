"""A long study's side processes are kept as they finish, so a stopped run starts again where it stopped, and only
for committed code: a result kept from uncommitted changes could not name the code that made it."""

from __future__ import annotations

import pytest

from benchmarks.studies import side_process
from polykv_agents.bench import provenance
from polykv_agents.bench.provenance import SourceCommit

SIDE = """
import json, sys
from pathlib import Path
request = json.loads(Path(sys.argv[1]).read_text())
with open(request["counter"], "a") as counter:
    counter.write("ran\\n")
Path(sys.argv[2]).write_text(json.dumps({"twice": 2 * request["value"]}))
"""


@pytest.mark.parametrize(("dirty", "runs"), [(False, 1), (True, 2)])
def test_a_finished_side_process_is_not_run_again_at_the_same_committed_code(tmp_path, monkeypatch, dirty, runs):
    script, counter, kept = tmp_path / "side.py", tmp_path / "counter.txt", tmp_path / "kept"
    script.write_text(SIDE)
    monkeypatch.setattr(provenance, "source_commit", lambda: SourceCommit("a" * 40, dirty))
    request = {"counter": str(counter), "value": 21}
    results = [
        side_process.run_side_kept(script, request, keep_in=kept, what="the test side", timeout_s=60) for _ in range(2)
    ]
    assert results == [{"twice": 42}, {"twice": 42}]
    assert counter.read_text().count("ran") == runs
    # another request is another measurement: run, not taken from what was kept
    side_process.run_side_kept(script, {**request, "value": 1}, keep_in=kept, what="the test side", timeout_s=60)
    assert counter.read_text().count("ran") == runs + 1
