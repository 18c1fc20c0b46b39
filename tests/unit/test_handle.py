"""PoolHandle: small, frozen, and unchanged by JSON and by LangGraph's checkpoint serializer."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Annotated, TypedDict

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, StateGraph
from pydantic import ValidationError

from polykv_agents import CompressionConfig, SharedKVPool
from polykv_agents.pool.handle import PoolHandle

DOC = "Shared caches let many agents read one document. " * 4


@pytest.fixture(scope="module")
def pool(tiny_model, tiny_tok) -> SharedKVPool:
    return SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=CompressionConfig.paper())


@pytest.fixture(scope="module")
def handle(pool, tmp_path_factory) -> PoolHandle:
    return PoolHandle.from_pool(pool, store_dir=tmp_path_factory.mktemp("pools"))


def test_from_pool_copies_what_identifies_the_pool(pool):
    handle = PoolHandle.from_pool(pool)
    assert (handle.digest, handle.fingerprint, handle.config) == (pool.digest, pool.fingerprint, pool.config)
    assert (handle.num_tokens, handle.nbytes, handle.store_dir) == (pool.num_tokens, pool.nbytes, None)


def test_store_dir_is_made_absolute(pool, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    handle = PoolHandle.from_pool(pool, store_dir="pools")
    assert handle.store_dir == str(tmp_path / "pools")
    assert Path(handle.store_dir).is_absolute()


def test_json_round_trip(handle):
    text = handle.model_dump_json()
    assert len(text) < 1000  # a handle, not a pool
    assert PoolHandle.model_validate_json(text) == handle


def test_handle_is_frozen_and_hashable(handle):
    with pytest.raises(ValidationError, match="frozen"):
        handle.digest = "0" * 64
    assert hash(handle) == hash(PoolHandle.model_validate_json(handle.model_dump_json()))


@pytest.mark.parametrize(
    "change",
    [{"digest": "../../etc/passwd"}, {"digest": "A" * 64}, {"num_tokens": 0}, {"nbytes": -1}, {"tensors": []}],
    ids=["traversal-digest", "uppercase-digest", "no-tokens", "negative-bytes", "extra-field"],
)
def test_invalid_fields_are_refused(handle, change):
    with pytest.raises(ValidationError):
        PoolHandle.model_validate({**handle.model_dump(), **change})


def test_langgraph_serializer_round_trip(handle):
    """By default LangGraph rebuilds the PoolHandle itself (logging that the type is not allow-listed)."""
    serde = JsonPlusSerializer()
    restored = serde.loads_typed(serde.dumps_typed(handle))
    assert isinstance(restored, PoolHandle)
    assert restored == handle


def test_strict_langgraph_serializer_returns_a_dict_that_validates_back(handle):
    """Strict mode (LANGGRAPH_STRICT_MSGPACK=true) returns the handle's fields as a plain dict."""
    strict = JsonPlusSerializer(allowed_msgpack_modules=None)
    restored = strict.loads_typed(strict.dumps_typed(handle))
    assert isinstance(restored, dict)
    assert PoolHandle.model_validate(restored) == handle


def test_allow_listed_handle_comes_back_as_a_handle_in_strict_mode(handle):
    serde = JsonPlusSerializer(allowed_msgpack_modules=None).with_msgpack_allowlist([PoolHandle])
    restored = serde.loads_typed(serde.dumps_typed(handle))
    assert isinstance(restored, PoolHandle)
    assert restored == handle


def test_handle_survives_a_checkpointed_graph(handle):
    class State(TypedDict):
        pool: PoolHandle | None
        seen: Annotated[list[str], operator.add]

    def prefetch(state: State) -> dict:
        return {"pool": handle, "seen": ["prefetch"]}

    def agent(state: State) -> dict:
        return {"seen": [PoolHandle.model_validate(state["pool"]).digest]}

    builder = StateGraph(State)
    builder.add_node("prefetch", prefetch)
    builder.add_node("agent", agent)
    builder.add_edge(START, "prefetch")
    builder.add_edge("prefetch", "agent")
    builder.add_edge("agent", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    run = {"configurable": {"thread_id": "t1"}}
    graph.invoke({"pool": None, "seen": []}, run)
    values = graph.get_state(run).values
    assert values["pool"] is not handle  # it went through the checkpoint's serializer
    assert PoolHandle.model_validate(values["pool"]) == handle
    assert values["seen"] == ["prefetch", handle.digest]


def test_a_checkpoint_written_with_the_old_module_path_still_loads(handle, monkeypatch):
    """Checkpoints before 0.2 name the class ``polykv_agents.handle.PoolHandle``; that path stays importable."""
    serde = JsonPlusSerializer()
    with monkeypatch.context() as patch:  # write the checkpoint as the old layout did
        patch.setattr(PoolHandle, "__module__", "polykv_agents.handle")
        old = serde.dumps_typed(handle)
    assert b"polykv_agents.handle" in old[1] and b"polykv_agents.pool.handle" not in old[1]
    restored = serde.loads_typed(old)
    assert isinstance(restored, PoolHandle)
    assert restored == handle
