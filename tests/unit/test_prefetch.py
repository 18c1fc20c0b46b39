"""The prefetch node on a tiny local checkpoint: one build per document, handles, and the baseline mode."""

from __future__ import annotations

import pytest

from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.graph.prefetch import PrefetchDocument
from polykv_agents.pool.registry import PoolRegistry
from polykv_agents.pool.store import PoolStore

DOC = "The review covers budgets, staffing and the reservoir programme. " * 5


def test_builds_once_and_binds_role_chats_to_the_pool(tiny_model_dir):
    registry = PoolRegistry()
    prefetch = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=4), registry=registry)
    state = {"document": DOC}
    state.update(prefetch(state))
    prefetch(state)  # a second run over the same document
    assert registry.build_count == 1
    reply = prefetch.pooled_chat(state).invoke("Summarise.")
    assert reply.usage_metadata["input_token_details"]["cache_read"] == state["pool"].num_tokens


def test_a_role_before_the_prefetch_node_is_a_clear_error(tiny_model_dir):
    prefetch = PrefetchDocument(ChatPolyKV(model=tiny_model_dir))
    with pytest.raises(ValueError, match="ran before the prefetch node"):
        prefetch.pooled_chat({"document": DOC})


def test_a_store_always_receives_the_pool_its_handle_names(tiny_model_dir, tmp_path):
    """A pool first built without a store is saved when a node with a store hands out its handle."""
    registry = PoolRegistry()
    chat = ChatPolyKV(model=tiny_model_dir)
    PrefetchDocument(chat, registry=registry)({"document": DOC})
    handle = PrefetchDocument(chat, registry=registry, store=tmp_path)({"document": DOC})["pool"]
    assert handle.digest in PoolStore(tmp_path)
    assert registry.build_count == 1


def test_baseline_mode_builds_nothing_and_prefills_the_document_on_every_call(tiny_model_dir):
    registry = PoolRegistry()
    pooled = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=6), registry=registry)
    baseline = PrefetchDocument(ChatPolyKV(model=tiny_model_dir, max_tokens=6), registry=registry, share_pool=False)
    state = {"document": DOC}
    assert baseline(state) == {"pool": None}
    assert registry.build_count == 0
    reply = baseline.pooled_chat(state).invoke("Summarise.")
    usage = reply.usage_metadata
    assert usage["input_token_details"]["cache_read"] == 0
    pooled_state = {**state, **pooled(state)}
    pooled_reply = pooled.pooled_chat(pooled_state).invoke("Summarise.")
    # The baseline runs the same tokens through the model that the pooled call reads from its pool.
    assert usage["input_tokens"] == pooled_reply.usage_metadata["input_tokens"]
