"""Checkpoint a document review in SQLite, then resume it in a new process that reloads the pool from disk.

    python examples/checkpoint_resume.py --phase first  --db reviews.sqlite --store pools/ --thread-id review-1
    python examples/checkpoint_resume.py --phase resume --db reviews.sqlite --store pools/ --thread-id review-1

``--phase first`` runs graphs/document_review.py up to the critic (``interrupt_before=["critic"]``):
the pool is built and saved to the store as ``<digest>.safetensors``, the planner and the specialists
answer, and the thread's state (with its pool handle as plain JSON, never tensors) is checkpointed in the SQLite file.
Several ``--thread-id`` run several threads over the same pool.

``--phase resume``, in a new process, continues each thread from its checkpoint: the critic and the
summarizer resolve the handle in state, which loads the pool from the store by digest (this process
builds nothing) or, if the file is gone, rebuilds it from the document in state (same digest).

Lines of the form ``KEY=value`` are for scripts and tests: ``POOL_BUILDS`` counts prefills in this process,
``POOL_SOURCE`` says where its pool came from (``prefill``, or ``store`` when loaded from disk).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from importlib import resources
from pathlib import Path

from langgraph.checkpoint.sqlite import SqliteSaver

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `graphs`

from graphs.document_review import build_graph
from polykv_agents import default_engine
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.store import PoolStore

INTERRUPT_BEFORE = ["critic"]


def report(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


def run_first(review, thread_ids: list[str], document: str, roles: list[str] | None) -> dict:
    results = {}
    for thread_id in thread_ids:
        config = {"configurable": {"thread_id": thread_id}}
        inputs = {"document": document} | ({"roles": roles} if roles else {})
        results[thread_id] = review.invoke(inputs, config, interrupt_before=INTERRUPT_BEFORE)
        snapshot = review.get_state(config)
        print(f"thread {thread_id}: {len(results[thread_id]['findings'])} findings, paused before {snapshot.next}")
        report("PAUSED", f"{thread_id}:{','.join(snapshot.next)}")
    return results


def run_resume(review, thread_ids: list[str]) -> dict:
    results = {}
    for thread_id in thread_ids:
        config = {"configurable": {"thread_id": thread_id}}
        snapshot = review.get_state(config)
        if tuple(snapshot.next) != tuple(INTERRUPT_BEFORE):
            msg = (
                f"thread {thread_id!r} is not paused before {INTERRUPT_BEFORE} in this database (next: "
                f"{snapshot.next}); run --phase first with the same --db and --thread-id first"
            )
            raise SystemExit(msg)
        results[thread_id] = state = review.invoke(None, config)
        for message in state["messages"][-2:]:  # the two calls made in this process
            # cache_read = the pool's tokens + those reused from earlier calls (the summarizer reads the critic's)
            reused = message.response_metadata["reused_tokens"]
            report(
                "POOL_READ", f"{message.name}:{message.usage_metadata['input_token_details']['cache_read'] - reused}"
            )
            report("REUSED", f"{message.name}:{reused}")
        print(f"thread {thread_id} critique: {state['critique'].strip()}")
        print(f"thread {thread_id} summary: {state['summary'].strip()}")
        report("RESUMED", thread_id)
    return results


def main(
    phase: str,
    db: str | Path,
    store: str | Path,
    thread_ids: list[str] | None = None,
    document: str | None = None,
    roles: list[str] | None = None,
    max_tokens: int = 32,
) -> dict:
    """Run ``phase`` ("first" or "resume") for each thread; return the final state of each thread."""
    thread_ids = thread_ids or ["review-1"]
    if document is None:
        document = resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    # The state holds the pool handle as plain JSON, so the default serializer stores and restores it as it
    # is: no allow-list, no "unregistered type" warning.
    conn = sqlite3.connect(str(db), check_same_thread=False)  # parallel branches run on worker threads
    try:
        review = build_graph(store=store, checkpointer=SqliteSaver(conn), max_tokens=max_tokens)
        if phase == "first":
            results = run_first(review, thread_ids, document, roles)
        elif phase == "resume":
            results = run_resume(review, thread_ids)
        else:
            msg = f"phase must be 'first' or 'resume', got {phase!r}"
            raise ValueError(msg)
    finally:
        conn.close()

    handle = PoolHandle.model_validate(next(iter(results.values()))["pool"])
    builds = default_engine().pools.builds_by_digest.get(handle.digest, 0)
    source = "prefill" if builds else ("store" if handle.digest in default_engine().pools else "not-needed")
    report("POOL_DIGEST", handle.digest)
    report("POOL_TOKENS", handle.num_tokens)
    report("POOL_BUILDS", default_engine().pools.build_count)
    report("POOL_SOURCE", source)
    report("POOL_IN_STORE", int(handle.digest in PoolStore(store)))
    report("DONE", phase)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["first", "resume"], required=True)
    parser.add_argument("--db", type=Path, default=Path("reviews.sqlite"), help="the SQLite checkpoint file")
    parser.add_argument("--store", type=Path, default=Path("pools"), help="the pool store directory")
    parser.add_argument("--thread-id", action="append", dest="thread_ids", help="repeat for several threads")
    parser.add_argument("--document", type=Path, help="a text file to review (default: the bundled sample)")
    parser.add_argument("--roles", nargs="+", help="specialist roles (first phase), at most 15")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    args = parser.parse_args()
    text = args.document.read_text(encoding="utf-8") if args.document else None
    main(args.phase, args.db, args.store, args.thread_ids, text, args.roles, args.max_tokens)
