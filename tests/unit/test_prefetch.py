"""The prefetch node on a tiny local checkpoint: one build per document, handles, engines, and the baseline."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from uuid import UUID

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tracers.run_collector import RunCollectorCallbackHandler
from usage import pool_read

from benchmarks.studies.baselines import ReprefillDocument
from graphs import role_swarm
from polykv_agents import Engine, default_engine
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.graph.prefetch import PrefetchDocument
from polykv_agents.graph.prefill_trace import PREFILL_RUN_NAME
from polykv_agents.pool.store import PoolStore

DOC = "The review covers budgets, staffing and the reservoir programme. " * 5


def test_builds_once_and_binds_role_chats_to_the_pool(tiny_model_dir):
    engine = Engine()
    prefetch = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=4), engine=engine)
    state = {"document": DOC}
    state.update(prefetch(state))
    prefetch(state)  # a second run over the same document
    assert engine.pools.build_count == 1
    reply = prefetch.pooled_chat(state).invoke("Summarise.")
    assert reply.usage_metadata["input_token_details"]["cache_read"] == state["pool"]["num_tokens"]


def _global_state() -> tuple[int, int, int, int]:
    engine = default_engine()
    return len(engine.models), len(engine.pools), engine.pools.build_count, len(engine.schedulers)


def _touched(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Whether a run added models, pools, builds or schedulers to the default engine. (Other tests' idle
    schedulers may retire meanwhile, and their pools may be evicted, so counts are allowed to fall.)"""
    return any(later > earlier for earlier, later in zip(before, after, strict=True))


def test_a_custom_engine_serves_a_whole_run_and_touches_nothing_global(tiny_model_dir):
    """Prefetch into an engine, then 15 parallel role calls: one pool built, all in that engine."""
    before = _global_state()
    engine = Engine()
    prefetch = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=5), engine=engine)
    state = {"document": DOC, **prefetch({"document": DOC})}

    def role_call(i: int):
        return prefetch.invoke_role(state, f"role{i}", [SystemMessage(f"You are analyst {i}."), HumanMessage("Go.")])

    with ThreadPoolExecutor(15) as executor:
        replies = list(executor.map(role_call, range(15)))
    assert all(pool_read(r) == state["pool"]["num_tokens"] for r in replies)
    assert engine.pools.build_count == 1 and len(engine.pools) == 1
    assert len(engine.models) == 1 and len(engine.schedulers) == 1
    assert not _touched(before, _global_state())
    assert state["pool"]["digest"] not in default_engine().pools
    engine.close()
    assert len(engine.schedulers) == 0


def test_an_engine_given_to_the_node_is_the_one_its_chat_model_uses(tiny_model_dir):
    engine = Engine()
    chat = ChatPolyKV(model=tiny_model_dir)
    prefetch = PrefetchDocument(chat, engine=engine)
    assert prefetch.engine is engine and prefetch.chat.engine is engine
    assert chat.engine is None  # the caller's chat model is not changed
    assert PrefetchDocument(ChatPolyKV(model=tiny_model_dir, engine=engine)).engine is engine


def test_a_role_before_the_prefetch_node_is_a_clear_error(tiny_model_dir):
    prefetch = PrefetchDocument(ChatPolyKV(model=tiny_model_dir))
    with pytest.raises(ValueError, match="ran before the prefetch node"):
        prefetch.pooled_chat({"document": DOC})


def test_a_store_always_receives_the_pool_its_handle_names(tiny_model_dir, tmp_path):
    """A pool first built without a store is saved when a node with a store hands out its handle."""
    engine = Engine()
    chat = ChatPolyKV(model=tiny_model_dir)
    PrefetchDocument(chat, engine=engine)({"document": DOC})
    handle = PrefetchDocument(chat, engine=engine, store=tmp_path)({"document": DOC})["pool"]
    assert handle["digest"] in PoolStore(tmp_path)
    assert engine.pools.build_count == 1


def test_the_baseline_builds_nothing_and_prefills_the_document_on_every_call(tiny_model_dir):
    engine = Engine()
    pooled = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=6), engine=engine)
    baseline = ReprefillDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=6), engine=engine)
    state = {"document": DOC}
    assert baseline(state) == {"pool": None}
    assert engine.pools.build_count == 0
    reply = baseline.pooled_chat(state).invoke("Summarise.")
    usage = reply.usage_metadata
    assert usage["input_token_details"]["cache_read"] == 0
    pooled_state = {**state, **pooled(state)}
    pooled_reply = pooled.pooled_chat(pooled_state).invoke("Summarise.")
    # The baseline runs the same tokens through the model that the pooled call reads from its pool.
    assert usage["input_tokens"] == pooled_reply.usage_metadata["input_tokens"]
    with pytest.raises(ValueError, match="no pooled model"):
        baseline.pooled_model(state)


def test_with_a_compiling_engine_the_prefetch_node_compiles_so_role_calls_do_not(tiny_model_dir):
    """engine.warm_up_decode runs in the prefetch node: the role calls after it, and later runs, build no graph."""
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    engine = Engine(compile_decode=counting_backend)
    try:
        prefetch = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=5), engine=engine)
        state = {"document": DOC, **prefetch({"document": DOC})}
        compiled = len(graphs)
        assert compiled > 0

        def role_call(i: int):
            return prefetch.invoke_role(
                state, f"role{i}", [SystemMessage(f"You are analyst {i}."), HumanMessage("Go.")]
            )

        with ThreadPoolExecutor(3) as executor:
            replies = list(executor.map(role_call, range(3)))
        assert all(r.usage_metadata["output_tokens"] > 0 for r in replies)
        prefetch({"document": DOC + " A second run."})
        assert len(graphs) == compiled
    finally:
        engine.close()


class RecordRuns(BaseCallbackHandler):
    """Every chat-model run a graph traced: its name, and the usage of its answer."""

    def __init__(self) -> None:
        self.names: dict[UUID, str] = {}
        self.usage: dict[str, list[dict]] = {}

    def on_chat_model_start(self, serialized, messages, *, run_id: UUID, name: str | None = None, **kwargs):
        self.names[run_id] = name or serialized.get("name")

    def on_llm_end(self, response, *, run_id: UUID, **kwargs):
        usage = response.generations[0][0].message.usage_metadata
        self.usage.setdefault(self.names[run_id], []).append(usage)


def test_the_document_prefill_is_a_traced_run_with_its_cache_usage(tiny_model_dir):
    """Tracing shows the prefill once (cache_creation = document tokens), then reads of the pool (cache_read)."""
    engine = Engine()
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=3, engine=engine)
    graph = role_swarm.build_graph(chat=chat)
    inputs = {"document": DOC, "question": "What is covered?", "roles": ["analyst", "skeptic"]}
    first, second = RecordRuns(), RecordRuns()
    state = graph.invoke(inputs, config={"callbacks": [first]})
    graph.invoke(inputs, config={"callbacks": [second]})  # the same document: the pool is in the engine
    tokens = state["pool"]["num_tokens"]
    (built,) = first.usage[PREFILL_RUN_NAME]
    assert built["input_token_details"] == {"cache_creation": tokens} and built["output_tokens"] == 0
    (reused,) = second.usage[PREFILL_RUN_NAME]
    assert reused["input_token_details"] == {"cache_read": tokens}
    role_calls = first.usage["ChatPolyKV"]
    # Every role call reads the pool; a later one may also read an earlier call's tokens (the prefix tree).
    reads = sorted(u["input_token_details"]["cache_read"] for u in role_calls)
    assert len(role_calls) == 3 and reads[0] == tokens and all(read >= tokens for read in reads)
    assert engine.pools.build_count == 1


def test_langchains_tracer_records_the_prefill_as_an_llm_run_of_the_prefetch_node(tiny_model_dir):
    """LangChain's run collector (a BaseTracer, as LangSmith's tracer is) sees an llm run inside the prefetch node."""
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=3, engine=Engine())
    graph = role_swarm.build_graph(chat=chat)
    collector = RunCollectorCallbackHandler()
    inputs = {"document": DOC + " traced", "question": "What?", "roles": ["analyst"]}
    graph.invoke(inputs, config={"callbacks": [collector]})
    (root,) = collector.traced_runs
    (prefetch,) = [run for run in root.child_runs if run.name == "prefetch"]
    (prefill,) = [run for run in prefetch.child_runs if run.name == PREFILL_RUN_NAME]
    assert prefill.run_type == "llm" and prefill.error is None
    usage = prefill.outputs["generations"][0][0]["message"]["kwargs"]["usage_metadata"]
    assert usage["input_token_details"]["cache_creation"] == usage["input_tokens"] > 0
