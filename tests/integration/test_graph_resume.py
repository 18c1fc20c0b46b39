"""A checkpointed document review resumed in fresh processes (examples/checkpoint_resume.py, three runs).

1. ``--phase first`` pauses two threads before the critic: one pool is built and saved to the store,
   both threads' checkpoints (with the pool handle as plain JSON) go to a SQLite file, read back with the
   default serializer and no "unregistered type" warning.
2. ``--phase resume`` for thread a, in a new process: the pool is loaded from the store by digest
   (``POOL_BUILDS=0``), the critic and summarizer read it, the thread finishes.
3. The store file is deleted; ``--phase resume`` for thread b (its first-phase checkpoint untouched):
   the pool is rebuilt from the document in state, deterministically, so with the same digest.

Each subprocess loads the model (about 20 s), so this module takes about a minute.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from langgraph.checkpoint.sqlite import SqliteSaver

from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.store import PoolStore

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `graphs` lives at the repository root, outside the package

from graphs.document_review import build_graph  # noqa: E402

EXAMPLE = ROOT / "examples" / "checkpoint_resume.py"
DOCUMENT = (
    "Minutes of the Riverside town council, 11 March. The council delayed the new library by one year because "
    "the lowest bid was 30 percent over budget. Road repairs start in May; two bus lines start in September."
)
_REPORT = re.compile(r"^([A-Z_]+)=(.*)$")


def run_example(*args: str | Path, cwd: Path) -> dict[str, list[str]]:
    """Run the example in a new Python process; its ``KEY=value`` lines, by key, in order."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert "unregistered type" not in done.stderr  # the handle in state is plain JSON, no custom type
    report: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        if match := _REPORT.match(line):
            report.setdefault(match[1], []).append(match[2])
    return report


def final_state(db: Path, thread_id: str) -> tuple[tuple[str, ...], dict]:
    """``(next nodes, values)`` of a thread in the SQLite file, read without running anything."""
    conn = sqlite3.connect(str(db), check_same_thread=False)
    try:
        saver = SqliteSaver(conn)  # the default serializer: the handle in state is plain JSON
        snapshot = build_graph(checkpointer=saver).get_state({"configurable": {"thread_id": thread_id}})
        return tuple(snapshot.next), snapshot.values
    finally:
        conn.close()


def test_resumed_threads_reload_the_pool_from_the_store_or_rebuild_it(tmp_path):
    document = tmp_path / "minutes.txt"
    document.write_text(DOCUMENT, encoding="utf-8")
    db, store = tmp_path / "reviews.sqlite", tmp_path / "pools"
    common = ["--db", db, "--store", store, "--document", document, "--max-tokens", "6"]

    # 1. Both threads pause before the critic; one pool is built and saved.
    first = run_example(
        "--phase", "first", *common, "--thread-id", "a", "--thread-id", "b", "--roles", "legal", "risk", cwd=tmp_path
    )
    assert first["PAUSED"] == ["a:critic", "b:critic"]
    assert first["POOL_BUILDS"] == ["1"]
    (digest,), (tokens,) = first["POOL_DIGEST"], first["POOL_TOKENS"]
    assert (store / f"{digest}.safetensors").is_file()
    next_nodes, values = final_state(db, "b")
    assert next_nodes == ("critic",)
    assert type(values["pool"]) is dict
    assert PoolHandle.model_validate(values["pool"]).store_dir == str(store.absolute())

    # 2. A fresh process resumes thread a: the pool comes from the store, nothing is prefilled.
    resumed = run_example("--phase", "resume", *common, "--thread-id", "a", cwd=tmp_path)
    assert resumed["RESUMED"] == ["a"]
    assert resumed["POOL_BUILDS"] == ["0"]
    assert resumed["POOL_SOURCE"] == ["store"]
    assert resumed["POOL_DIGEST"] == [digest]
    assert resumed["POOL_READ"] == [f"critic:{tokens}", f"summarizer:{tokens}"]
    critic_reused, summarizer_reused = (int(entry.split(":")[1]) for entry in resumed["REUSED"])
    assert critic_reused == 0 < summarizer_reused  # the summarizer continues the critic's conversation
    next_nodes, values = final_state(db, "a")
    assert next_nodes == ()
    assert isinstance(values["summary"], str)
    assert [m.name for m in values["messages"]] == ["planner", "legal", "risk", "critic", "summarizer"]

    # 3. Without the store file, thread b's pool is rebuilt from the document in state: same digest.
    PoolStore(store).delete(digest)
    rebuilt = run_example("--phase", "resume", *common, "--thread-id", "b", cwd=tmp_path)
    assert rebuilt["RESUMED"] == ["b"]
    assert rebuilt["POOL_BUILDS"] == ["1"]
    assert rebuilt["POOL_SOURCE"] == ["prefill"]
    assert rebuilt["POOL_DIGEST"] == [digest]
    assert rebuilt["POOL_READ"] == [f"critic:{tokens}", f"summarizer:{tokens}"]
    critic_reused, summarizer_reused = (int(entry.split(":")[1]) for entry in rebuilt["REUSED"])
    assert critic_reused == 0 < summarizer_reused  # the summarizer continues the critic's conversation
    assert rebuilt["POOL_IN_STORE"] == ["1"]  # the rebuild saved it again
    assert final_state(db, "b")[0] == ()
