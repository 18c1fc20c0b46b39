"""PoolRegistry on a tiny random Llama: each pool built once, reloaded from a store, rebuilt from a document."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import tiny_llama

from polykv_agents import CompressionConfig, SharedKVPool, default_engine
from polykv_agents.pool import documents as documents_module
from polykv_agents.pool import registry as registry_module
from polykv_agents.pool import shared_pool as shared_pool_module
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.registry import PoolNotFoundError, PoolRegistry
from polykv_agents.pool.store import PoolFileError, PoolStore

DOC = "Planner, critic, summarizer: shared caches let many agents read one document. " * 4
OTHER_DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 4
TIMEOUT_S = 60  # generous: a deadlock fails the test instead of hanging the suite


@pytest.fixture
def slow_prefill(monkeypatch):
    """Widen the window in which concurrent callers can race for the same build."""
    original = SharedKVPool.prefill.__func__

    def prefill(cls, *args, **kwargs):
        time.sleep(0.2)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(SharedKVPool, "prefill", classmethod(prefill))


# ---------------------------------------------------------------- get_or_build


def test_get_or_build_builds_once_per_document(tiny_model, tiny_tok):
    registry = PoolRegistry()
    first = registry.get_or_build(tiny_model, tiny_tok, DOC)
    assert registry.get_or_build(tiny_model, tiny_tok, DOC) is first
    assert registry.build_count == 1
    assert registry.builds_by_digest == {first.digest: 1}
    assert first.digest in registry and len(registry) == 1 and registry.get(first.digest) is first

    other = registry.get_or_build(tiny_model, tiny_tok, OTHER_DOC)
    paper = registry.get_or_build(tiny_model, tiny_tok, DOC, config=CompressionConfig.paper())
    assert len({first.digest, other.digest, paper.digest}) == 3
    assert registry.build_count == 3


def test_the_digest_is_known_before_the_prefill(tiny_model, tiny_tok):
    """A pool put into the registry by hand is found without prefilling again."""
    registry = PoolRegistry()
    digest = registry.digest_of(tiny_model, tiny_tok, DOC)
    paper = registry.digest_of(tiny_model, tiny_tok, DOC, CompressionConfig.paper())
    assert (registry.build_count, len(registry)) == (0, 0)  # tokenizing was enough
    registry.put(SharedKVPool.prefill(tiny_model, tiny_tok, DOC))
    assert registry.get_or_build(tiny_model, tiny_tok, DOC).digest == digest
    assert registry.get_or_build(tiny_model, tiny_tok, DOC, config=CompressionConfig.paper()).digest == paper != digest
    assert registry.build_count == 1


def test_a_fresh_registry_loads_from_the_store_instead_of_building(tiny_model, tiny_tok, tmp_path):
    store = PoolStore(tmp_path)
    built = PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC, store=store)
    assert built.digest in store

    fresh = PoolRegistry()  # a new process: empty registry, same directory
    loaded = fresh.get_or_build(tiny_model, tiny_tok, DOC, store=PoolStore(tmp_path))
    assert fresh.build_count == 0
    assert loaded is not built
    assert (loaded.digest, loaded.tensor_checksum()) == (built.digest, built.tensor_checksum())


def test_a_pool_registered_without_a_store_is_saved_when_a_store_asks_for_it(tiny_model, tiny_tok, tmp_path):
    registry = PoolRegistry()
    pool = registry.get_or_build(tiny_model, tiny_tok, DOC)  # no store yet
    store = PoolStore(tmp_path)
    assert registry.get_or_build(tiny_model, tiny_tok, DOC, store=store) is pool
    assert pool.digest in store  # so a thread resumed elsewhere loads it instead of prefilling
    assert registry.build_count == 1


def test_a_failed_save_warns_and_still_returns_the_pool(tiny_model, tiny_tok, tmp_path, monkeypatch):
    def failing_save(self, pool):
        raise OSError("read-only file system")

    monkeypatch.setattr(PoolStore, "save", failing_save)
    registry = PoolRegistry()
    digest = registry.digest_of(tiny_model, tiny_tok, DOC)
    with pytest.warns(UserWarning, match=rf"could not save pool {digest[:12]}\.\.\. to .*read-only") as caught:
        pool = registry.get_or_build(tiny_model, tiny_tok, DOC, store=PoolStore(tmp_path))
    assert registry.get(pool.digest) is pool
    assert caught[0].filename == __file__  # the warning names the caller's line, not the registry's
    handle = PoolHandle.from_pool(pool, store_dir=tmp_path)
    with pytest.warns(UserWarning, match="could not save pool") as caught:  # the rebuild path is deeper
        PoolRegistry().resolve(handle, tiny_model, tiny_tok, document=DOC)
    assert caught[0].filename == __file__


def test_the_chunk_size_reaches_the_prefill(tiny_model, tiny_tok, monkeypatch):
    chunk_sizes = []
    original = SharedKVPool.prefill_tokens.__func__

    def prefill_tokens(cls, *args, **kwargs):
        chunk_sizes.append(kwargs["chunk_size"])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(SharedKVPool, "prefill_tokens", classmethod(prefill_tokens))
    PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC, chunk_size=7)
    assert chunk_sizes == [7]


def test_a_model_that_changes_during_the_build_is_logged(tiny_model, tiny_tok, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger=registry_module.__name__):
        PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC)
        assert caplog.records == []  # the usual case: the digest computed first is the pool's
        monkeypatch.setattr(registry_module, "pool_digest", lambda *args, **kwargs: "0" * 64)  # a digest gone stale
        pool = PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC)
    assert pool.digest != "0" * 64
    expected = f"model {tiny_model} changed during the build; pool registered under its new digest"
    assert [record.getMessage() for record in caplog.records] == [expected]


def test_a_bf16_copy_reads_the_pool_its_fp32_model_built_and_fp16_does_not(tiny_tok):
    """A pool holds codes, so a re-cast to bf16 finds the same pool (no second prefill). Fingerprints are
    memoised (tests/unit/test_fingerprint.py), and the memo must still follow the cast: fp16 rounds the
    weights differently, which is another pool."""
    model, registry = tiny_llama(), PoolRegistry()
    first = registry.get_or_build(model, tiny_tok, DOC)
    model.to(torch.bfloat16)
    assert registry.get_or_build(model, tiny_tok, DOC) is first
    assert registry.build_count == 1
    model.to(torch.float16)
    third = registry.get_or_build(model, tiny_tok, DOC)
    assert third.fingerprint.dtype == "float16"
    assert third.digest != first.digest
    assert registry.build_count == 2


def test_bad_input_is_refused_before_any_work(tiny_model, tiny_tok):
    registry = PoolRegistry()
    with pytest.raises(TypeError, match="not a causal language model"):
        registry.get_or_build(object(), tiny_tok, DOC)
    with pytest.raises(ValueError, match="empty"):
        registry.get_or_build(tiny_model, tiny_tok, "   ")
    with pytest.raises(TypeError, match="must be a SharedKVPool, got str"):
        registry.put("not a pool")
    assert registry.build_count == 0 and len(registry) == 0


def test_discard_and_clear(tiny_model, tiny_tok):
    registry = PoolRegistry()
    pool = registry.get_or_build(tiny_model, tiny_tok, DOC)
    with (
        registry.leased(pool),
        pytest.raises(RuntimeError, match=rf"pool {pool.digest[:12]}\.\.\. is in use by 1 call"),
    ):
        registry.discard(pool.digest)
    registry.discard(pool.digest)
    registry.discard(pool.digest)
    assert pool.digest not in registry
    registry.get_or_build(tiny_model, tiny_tok, DOC)
    assert (registry.build_count, registry.builds_by_digest) == (2, {pool.digest: 2})
    registry.clear()
    assert (len(registry), registry.build_count, registry.builds_by_digest) == (0, 0, {})


def test_the_process_wide_registry_is_a_registry():
    assert isinstance(default_engine().pools, PoolRegistry)


# ---------------------------------------------------------------- resolve


def test_resolve_from_the_registry(tiny_model, tiny_tok):
    registry = PoolRegistry()
    pool = registry.get_or_build(tiny_model, tiny_tok, DOC)
    handle = PoolHandle.from_pool(pool)
    assert registry.resolve(handle, tiny_model, tiny_tok) is pool
    assert registry.resolve(handle.model_dump(), tiny_model, tiny_tok) is pool  # a strict checkpoint's dict


def test_resolve_from_the_store_in_a_fresh_registry(tiny_model, tiny_tok, tmp_path):
    pool = PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC, store=PoolStore(tmp_path))
    handle = PoolHandle.from_pool(pool, store_dir=tmp_path)
    fresh = PoolRegistry()
    resolved = fresh.resolve(handle, tiny_model, tiny_tok)
    assert (resolved.digest, resolved.tensor_checksum()) == (pool.digest, pool.tensor_checksum())
    assert fresh.build_count == 0
    assert fresh.resolve(handle, tiny_model, tiny_tok) is resolved


def test_resolve_rebuilds_deterministically_when_the_file_is_gone(tiny_model, tiny_tok, tmp_path):
    store = PoolStore(tmp_path)
    pool = PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC, store=store)
    handle = PoolHandle.from_pool(pool, store_dir=tmp_path)
    store.delete(pool.digest)

    fresh = PoolRegistry()
    rebuilt = fresh.resolve(handle, tiny_model, tiny_tok, document=DOC)
    assert fresh.build_count == 1
    assert (rebuilt.digest, rebuilt.tensor_checksum()) == (pool.digest, pool.tensor_checksum())
    assert pool.digest in store  # saved again for the next process


def test_resolve_without_pool_store_or_document_says_what_to_do(tiny_model, tiny_tok, tmp_path):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    for handle, where in (
        (PoolHandle.from_pool(pool), "no store was given"),
        (PoolHandle.from_pool(pool, store_dir=tmp_path), f"no saved copy is in {tmp_path}"),
    ):
        message = (
            rf"^pool {pool.digest[:12]}\.\.\. is unknown in this process, {where}, and no document was given to "
            r"rebuild it; run the prefetch node \(which builds the pool\) first, or pass document= to resolve\(\)$"
        )
        with pytest.raises(PoolNotFoundError, match=message):
            PoolRegistry().resolve(handle, tiny_model, tiny_tok)


def test_resolve_refuses_a_different_document_without_building(tiny_model, tiny_tok):
    handle = PoolHandle.from_pool(SharedKVPool.prefill(tiny_model, tiny_tok, DOC))
    registry = PoolRegistry()
    other = registry.digest_of(tiny_model, tiny_tok, OTHER_DOC)
    message = (
        rf"rebuild pool {handle.digest[:12]}\.\.\. is not the one it was built from "
        rf"\(it gives pool {other[:12]}\.\.\.\); pass the document that was in the graph state when the pool was built$"
    )
    with pytest.raises(ValueError, match=message):
        registry.resolve(handle, tiny_model, tiny_tok, document=OTHER_DOC)
    assert registry.build_count == 0 and len(registry) == 0


def test_resolve_rebuilds_with_the_handle_s_config(tiny_model, tiny_tok):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=CompressionConfig.paper())
    rebuilt = PoolRegistry().resolve(PoolHandle.from_pool(pool), tiny_model, tiny_tok, document=DOC)
    assert (rebuilt.config, rebuilt.digest) == (pool.config, pool.digest)


def test_resolve_refuses_another_model_even_on_a_registry_hit(tiny_model, tiny_tok):
    registry = PoolRegistry()
    handle = PoolHandle.from_pool(registry.get_or_build(tiny_model, tiny_tok, DOC))
    with pytest.raises(ValueError, match="weights_sha"):
        registry.resolve(handle, tiny_llama(seed=1), tiny_tok, document=DOC)
    with pytest.raises(ValueError, match="head_dim"):
        registry.resolve(handle, tiny_llama(head_dim=32), tiny_tok)


def test_resolve_propagates_a_corrupted_store_file(tiny_model, tiny_tok, tmp_path):
    store = PoolStore(tmp_path)
    pool = PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC, store=store)
    store.path_for(pool.digest).write_bytes(b"\x00" * 64)
    with pytest.raises(PoolFileError, match="delete it"):
        PoolRegistry().resolve(PoolHandle.from_pool(pool, store_dir=tmp_path), tiny_model, tiny_tok, document=DOC)


# ---------------------------------------------------------------- threads


def test_concurrent_requests_for_one_document_build_it_once(tiny_model, tiny_tok, slow_prefill):
    registry, start = PoolRegistry(), threading.Barrier(8)

    def request():
        start.wait(TIMEOUT_S)
        return registry.get_or_build(tiny_model, tiny_tok, DOC)

    with ThreadPoolExecutor(8) as executor:
        pools = [f.result(TIMEOUT_S) for f in [executor.submit(request) for _ in range(8)]]
    assert registry.build_count == 1
    assert all(pool is pools[0] for pool in pools)


def test_concurrent_builds_of_different_documents_run_in_parallel(tiny_model, tiny_tok, monkeypatch):
    documents = [f"Document number {i}. " * 10 for i in range(4)]
    # Every prefill waits until all four are running: serialised builds would break this barrier.
    all_building = threading.Barrier(4, timeout=TIMEOUT_S)
    original = SharedKVPool.prefill.__func__

    def prefill(cls, *args, **kwargs):
        all_building.wait()
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(SharedKVPool, "prefill", classmethod(prefill))
    registry, start = PoolRegistry(), threading.Barrier(8)

    def request(document):
        start.wait(TIMEOUT_S)
        return registry.get_or_build(tiny_model, tiny_tok, document)

    with ThreadPoolExecutor(8) as executor:
        futures = [executor.submit(request, documents[i % 4]) for i in range(8)]
        pools = [f.result(TIMEOUT_S) for f in futures]
    assert registry.build_count == 4
    assert set(registry.builds_by_digest.values()) == {1}
    assert len({pool.digest for pool in pools}) == 4


def test_a_waiter_retries_with_its_own_document_when_the_first_caller_fails(
    tiny_model, tiny_tok, tmp_path, monkeypatch
):
    """The first caller has no document (PoolNotFoundError); the one waiting on it has, and must not inherit that."""
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC)
    handle = PoolHandle.from_pool(pool, store_dir=tmp_path)
    registry, release = PoolRegistry(), threading.Event()
    original_load = PoolStore.load

    def slow_load(self, digest):
        release.wait(TIMEOUT_S)
        return original_load(self, digest)

    monkeypatch.setattr(PoolStore, "load", slow_load)
    with ThreadPoolExecutor(2) as executor:
        without = executor.submit(registry.resolve, handle, tiny_model, tiny_tok)
        time.sleep(0.1)  # let it own the build; if the second call came first the test still holds
        with_document = executor.submit(registry.resolve, handle, tiny_model, tiny_tok, document=DOC)
        time.sleep(0.1)
        release.set()
        with pytest.raises(PoolNotFoundError):
            without.result(TIMEOUT_S)
        assert with_document.result(TIMEOUT_S).digest == pool.digest
    assert registry.build_count == 1


def test_a_build_tokenizes_the_document_once(tiny_model, tiny_tok, monkeypatch):
    """The digest and the prefill read the same token ids: a prefetch tokenizes its document once."""
    calls = []
    tokenize = documents_module.tokenize_document

    def counting(*args, **kwargs):
        calls.append(args)
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(documents_module, "tokenize_document", counting)
    monkeypatch.setattr(registry_module, "tokenize_document", counting)
    monkeypatch.setattr(shared_pool_module, "tokenize_document", counting)
    PoolRegistry().get_or_build(tiny_model, tiny_tok, DOC + " Tokenized once.")
    assert len(calls) == 1
