"""Load and soak on the tiny checkpoint: 200 concurrent calls with no cross-talk, 300 workflow runs with
bounded memory. The same harness runs on SmolLM2 in benchmarks/load_soak.py (figures in docs/RELIABILITY.md)."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest
from langgraph.checkpoint.sqlite import SqliteSaver
from tiny_models import tiny_sensitive_llama, tiny_tokenizer

from benchmarks.studies.load import load_cases, run_load
from benchmarks.studies.soak import growth, run_soak
from polykv_agents import Engine, SharedKVPool, load_model
from polykv_agents.chat.chat_model import ChatPolyKV

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `graphs`

from graphs import role_swarm

DOC = "Shared caches let many agents read one document. Values use a rotated three-bit codebook. " * 4
ROLES = [f"role {i}" for i in range(15)]


@pytest.fixture(scope="module")
def sensitive_model_dir(tmp_path_factory) -> str:
    """A tiny Llama whose answers depend strongly on the prompt, so an answer given to the wrong agent shows."""
    directory = tmp_path_factory.mktemp("sensitive-llama")
    tiny_sensitive_llama().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def test_200_concurrent_calls_from_threads_and_asyncio_each_get_their_answer_alone(sensitive_model_dir):
    model, tokenizer = load_model(sensitive_model_dir)
    pool = SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": DOC}])
    chat = ChatPolyKV(model=sensitive_model_dir, max_tokens=8).with_pool(pool)
    cases = load_cases(200, ROLES)
    assert len({(c.role, c.question) for c in cases}) == 200
    results, answers = run_load(chat, cases)
    assert {r.mode: r.mismatches for r in results} == {"sequential": 0, "threads": 0, "asyncio": 0}
    assert len(set(answers["threads"])) > 20  # the cases really differ: cross-talk would show
    # The reference itself equals HF's own attention over a private decoded copy of the pool.
    private = ChatPolyKV(model=sensitive_model_dir, max_tokens=8, runtime="private").with_pool(pool)
    assert [str(private.invoke(c.messages()).content) for c in cases[:30]] == answers["sequential"][:30]


@pytest.fixture
def soak_engine():
    """Small budgets and a short scheduler idle time, so that 300 runs reach the steady state."""
    engine = Engine(max_pool_bytes=2 * 1024 * 1024, scheduler_idle_seconds=0.5, max_prefix_bytes=256 * 1024)
    yield engine
    engine.close()


def test_300_workflow_runs_keep_memory_tensors_and_threads_bounded(tiny_model_dir, tmp_path, soak_engine):
    conn = sqlite3.connect(tmp_path / "threads.sqlite", check_same_thread=False)
    saver = SqliteSaver(conn)  # the handle in state is plain JSON: no allow-list
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=6)
    graph = role_swarm.build_graph(chat=chat, checkpointer=saver, engine=soak_engine)

    def invoke(run: int):
        state = {"document": f"{DOC}\nCopy {run}.", "question": "What is shared?", "roles": ROLES[:3]}
        return graph.invoke(state, {"configurable": {"thread_id": f"soak-{run}"}})

    def check(run: int, result) -> None:
        assert len(result["answers"]) == 3 and result["answer"] is not None

    samples = run_soak(invoke, runs=300, sample_every=25, check=check)
    grew = growth(samples, warmup_runs=100)
    # Bounds: each run builds a new pool (the registry keeps ~2 MiB of them) and starts a scheduler
    # that retires 0.5 s after its run; nothing may accumulate per run.
    assert grew.live_tensors <= 150, samples
    assert grew.live_tensor_bytes <= 4 * 1024 * 1024, samples
    assert grew.threads <= 8, samples
    assert grew.rss_bytes <= 64 * 1024 * 1024, samples
    assert soak_engine.pools.build_count >= 300  # every run built its pool in the engine it was given
    conn.close()
