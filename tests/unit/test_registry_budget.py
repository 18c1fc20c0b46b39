"""PoolRegistry's byte budget: least recently used pools are evicted, pools in use never are."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from polykv_agents import Engine, SharedKVPool
from polykv_agents import engine as engine_module
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.pool import registry as registry_module
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.registry import PoolRegistry
from polykv_agents.pool.store import PoolStore

DOCS = [f"Document {i}: shared caches let many agents read one document, compressed once. " * 3 for i in range(4)]


@pytest.fixture(scope="module")
def pools(tiny_model, tiny_tok) -> list[SharedKVPool]:
    built = [SharedKVPool.prefill(tiny_model, tiny_tok, doc) for doc in DOCS]
    assert len({p.nbytes for p in built}) == 1  # equal sizes keep the budget arithmetic readable
    return built


def test_least_recently_used_pools_are_evicted_beyond_the_budget(pools, caplog):
    a, b, c, d = pools
    registry = PoolRegistry(max_bytes=3 * a.nbytes)
    for pool in (a, b, c):
        registry.put(pool)
    assert registry.get(a.digest) is a  # a is now the most recently used, b the least
    with caplog.at_level(logging.INFO, logger=registry_module.__name__):
        registry.put(d)
    expected = f"evicted pool {b.digest[:12]}... (least recently used) to stay within {3 * a.nbytes} bytes"
    assert [record.getMessage() for record in caplog.records] == [expected]
    assert b.digest not in registry
    assert [p.digest in registry for p in (a, c, d)] == [True, True, True]
    assert registry.nbytes == 3 * a.nbytes
    assert registry.evictions == 1


def test_resolving_a_registered_pool_makes_it_the_most_recently_used(pools, tiny_model, tiny_tok):
    a, b, c, _ = pools
    registry = PoolRegistry(max_bytes=2 * a.nbytes)
    registry.put(a)
    registry.put(b)
    assert registry.resolve(PoolHandle.from_pool(a), tiny_model, tiny_tok) is a  # b is now the least recently used
    registry.put(c)
    assert [p.digest in registry for p in (a, b, c)] == [True, False, True]


def test_a_pool_in_use_is_never_evicted(pools, caplog):
    a, b, c, _ = pools
    registry = PoolRegistry(max_bytes=a.nbytes)
    with registry.leased(a):
        registry.put(b)  # a is in use, b is the newest: both stay, over budget, and the registry says so
        with caplog.at_level(logging.WARNING, logger=registry_module.__name__):
            registry.put(c)
        assert a.digest in registry and c.digest in registry and b.digest not in registry
        expected = (
            f"pool registry holds {2 * a.nbytes} bytes, over its {a.nbytes}-byte budget: every other pool is in use"
        )
        assert expected in [record.getMessage() for record in caplog.records]
        assert registry.leases(a.digest) == 1
        with pytest.raises(RuntimeError, match="in use"):
            registry.discard(a.digest)
    # The lease ended: the budget applies again. The call that held a has just used it, so the least
    # recently used pool is now c, and c goes.
    assert registry.leases(a.digest) == 0
    assert a.digest in registry and c.digest not in registry


def test_a_budget_met_exactly_after_an_eviction_is_not_reported_as_exceeded(pools, caplog):
    a, b, _, _ = pools
    registry = PoolRegistry(max_bytes=a.nbytes)
    registry.put(a)
    with caplog.at_level(logging.WARNING, logger=registry_module.__name__):
        registry.put(b)
    assert [p.digest in registry for p in (a, b)] == [False, True]
    assert caplog.records == []


def test_the_newest_pool_stays_even_when_it_alone_exceeds_the_budget(pools):
    registry = PoolRegistry(max_bytes=pools[0].nbytes // 2)
    registry.put(pools[0])
    assert pools[0].digest in registry
    registry.put(pools[1])
    assert pools[0].digest not in registry and pools[1].digest in registry


def test_lowering_the_budget_evicts_at_once_and_bad_budgets_are_refused(pools):
    registry = PoolRegistry()
    for pool in pools:
        registry.put(pool)
    registry.max_bytes = 2 * pools[0].nbytes
    assert (len(registry), registry.evictions) == (2, 2)
    for bad in (-1, 1.5, "1GB", True):
        with pytest.raises(ValueError, match="max_bytes"):
            registry.max_bytes = bad


def test_an_evicted_pool_comes_back_from_its_store_without_a_prefill(tiny_model, tiny_tok, tmp_path):
    registry = PoolRegistry(max_bytes=1)  # keeps only the newest pool
    store = PoolStore(tmp_path)
    first = registry.get_or_build(tiny_model, tiny_tok, DOCS[0], store=store)
    registry.get_or_build(tiny_model, tiny_tok, DOCS[1], store=store)
    assert first.digest not in registry
    handle = PoolHandle.from_pool(first, store_dir=tmp_path)
    again = registry.resolve(handle, tiny_model, tiny_tok)
    assert again.tensor_checksum() == first.tensor_checksum()
    assert registry.build_count == 2  # loaded, not rebuilt


def test_an_evicted_pool_spills_and_comes_back_by_digest_alone(tiny_model, tiny_tok, tmp_path):
    """With a spill store, a pool the budget evicts is written there once, and a handle that names no store (and
    no document to rebuild from) still resolves, loaded back, not prefilled."""
    spill = PoolStore(tmp_path)
    registry = PoolRegistry(max_bytes=1, spill=spill)  # keeps only the newest pool
    first = registry.get_or_build(tiny_model, tiny_tok, DOCS[0])
    with registry.leased(first):
        registry.get_or_build(tiny_model, tiny_tok, DOCS[1])  # over budget, but first is in use: nothing spills
        assert registry.spills == 0 and first.digest not in spill
    registry.get_or_build(tiny_model, tiny_tok, DOCS[2])  # the lease ended: first and second go, to the spill store
    assert first.digest not in registry and first.digest in spill and registry.spills == 2
    again = registry.resolve(PoolHandle.from_pool(first), tiny_model, tiny_tok)
    assert again.tensor_checksum() == first.tensor_checksum()
    assert registry.origin(first.digest) == "spill"
    assert registry.get_or_build(tiny_model, tiny_tok, DOCS[1]).digest in registry  # by document: loaded too
    assert registry.build_count == 3  # three documents, each prefilled once
    registry.get_or_build(tiny_model, tiny_tok, DOCS[3])  # the pools of the first three documents left again
    assert registry.spills == 3 and len(list(tmp_path.iterdir())) == 3  # each written once, however often it left


def test_a_chat_model_over_a_spilled_pool_answers_from_it_without_a_prefill(tiny_model_dir, tmp_path):
    engine = Engine(max_pool_bytes=1, spill_dir=tmp_path)
    model, tokenizer = engine.load_model(tiny_model_dir)
    pool = engine.pools.get_or_build(model, tokenizer, DOCS[0])
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=6, engine=engine).with_pool(PoolHandle.from_pool(pool))
    expected = chat.invoke("Go.").content
    engine.pools.get_or_build(model, tokenizer, DOCS[1])  # evicts the chat's pool, into the spill store
    assert pool.digest not in engine.pools
    reply = chat.invoke("Go.")
    assert reply.content == expected
    assert reply.response_metadata["pool_source"] == "spill"
    assert engine.pools.build_count == 2


def test_the_budget_counts_decoded_prefixes_and_frees_them_with_their_pool(tiny_model_dir, tmp_path):
    """An engine's budget covers the decoded prefix each pool's scheduler holds: a call over a new document
    that takes the total past it evicts the least recently used idle pool, retires its scheduler and spills it."""
    from polykv_agents import PooledAgent
    from polykv_agents.sampling.settings import GenerationSettings

    engine = Engine(max_pool_bytes=None, spill_dir=tmp_path)
    model, tokenizer = engine.load_model(tiny_model_dir)
    a, b = (engine.pools.get_or_build(model, tokenizer, doc) for doc in DOCS[:2])  # a: the least recently used
    settings = GenerationSettings(max_new_tokens=6, ignore_eos=True)
    over_a, over_b = (PooledAgent(pool, model, tokenizer, engine=engine) for pool in (a, b))
    expected = list(over_a.generate_ids("Go.", settings))
    decoded = engine.schedulers.decoded_nbytes(a.digest)
    assert decoded > a.nbytes  # the decoded prefix is larger than the compressed pool
    assert engine.pools.resident_nbytes == a.nbytes + b.nbytes + decoded
    engine.pools.max_bytes = a.nbytes + b.nbytes + decoded  # met exactly: nothing goes
    assert a.digest in engine.pools and len(engine.schedulers) == 1
    list(over_b.generate_ids("Go.", settings))  # b's scheduler starts: its decoded prefix takes the total over
    assert a.digest not in engine.pools and a.digest in engine.pools.spill
    assert engine.schedulers.decoded_nbytes(a.digest) == 0 and len(engine.schedulers) == 1  # a's retired
    assert engine.pools.resident_nbytes <= engine.pools.max_bytes
    assert list(over_a.generate_ids("Go.", settings)) == expected  # its agent still holds the pool itself


def test_a_pool_with_a_call_running_is_in_use_and_stays(tiny_model_dir):
    from polykv_agents import PooledAgent
    from polykv_agents.sampling.settings import GenerationSettings

    engine = Engine(max_pool_bytes=1)
    model, tokenizer = engine.load_model(tiny_model_dir)
    a = engine.pools.get_or_build(model, tokenizer, DOCS[0])
    running = PooledAgent(a, model, tokenizer, engine=engine).generate_ids(
        "Go.", GenerationSettings(max_new_tokens=64, ignore_eos=True)
    )
    first = next(running)  # a's scheduler is decoding
    b = engine.pools.get_or_build(model, tokenizer, DOCS[1])  # over budget, but a is in use: it stays
    assert a.digest in engine.pools and b.digest in engine.pools
    assert len([first, *running]) == 64
    (scheduler,) = engine.schedulers.live()
    for _ in range(200):  # the worker ends the finished row just after its last token
        if not scheduler.busy:
            break
        time.sleep(0.01)
    engine.pools.enforce_budget()  # the call ended: now a goes
    assert a.digest not in engine.pools and engine.schedulers.decoded_nbytes(a.digest) == 0


def test_a_chat_call_holds_a_lease_while_it_streams(tiny_model_dir):
    engine = Engine(max_pool_bytes=1)
    registry = engine.pools
    model, tokenizer = engine.load_model(tiny_model_dir)
    pool = SharedKVPool.prefill(model, tokenizer, DOCS[0])
    other = SharedKVPool.prefill(model, tokenizer, DOCS[1])
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=8, engine=engine).with_pool(
        PoolHandle.from_pool(pool), document=DOCS[0]
    )
    registry.put(pool)
    stream = chat.stream("What is shared?")
    next(stream)
    assert registry.leases(pool.digest) == 1
    registry.put(other)  # over budget, but the streaming call's pool stays
    assert pool.digest in registry
    list(stream)
    assert registry.leases(pool.digest) == 0
    # The budget applies as soon as the call ends: the call's pool was just used, so the other one goes.
    assert pool.digest in registry and other.digest not in registry
    assert registry.build_count == 0


def test_concurrent_calls_under_a_tight_budget_all_complete(tiny_model_dir):
    """Pools churn in and out of a one-pool budget while calls over four documents run at once."""
    engine = Engine(max_pool_bytes=1)
    registry = engine.pools
    model, tokenizer = engine.load_model(tiny_model_dir)
    chats = []
    for doc in DOCS:
        handle = PoolHandle.from_pool(registry.get_or_build(model, tokenizer, doc))
        chats.append(ChatPolyKV(model=tiny_model_dir, max_tokens=6, engine=engine).with_pool(handle, document=doc))
    expected = [chat.invoke("Go.").content for chat in chats]
    with ThreadPoolExecutor(8) as executor:
        answers = list(executor.map(lambda i: chats[i % 4].invoke("Go.").content, range(32)))
    assert answers == [expected[i % 4] for i in range(32)]
    assert all(registry.leases(chat.pool.digest) == 0 for chat in chats)


def test_a_chat_model_given_a_pool_object_keeps_it_through_eviction(tiny_model_dir):
    """``with_pool(pool)`` hands over the pool itself: eviction from the registry must not lose it."""
    engine = Engine(max_pool_bytes=1)
    registry = engine.pools
    model, tokenizer = engine.load_model(tiny_model_dir)
    pool = SharedKVPool.prefill(model, tokenizer, DOCS[0])
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=6, engine=engine).with_pool(pool)  # no store, no document
    expected = chat.invoke("Go.").content
    registry.put(SharedKVPool.prefill(model, tokenizer, DOCS[1]))
    assert pool.digest not in registry
    assert chat.invoke("Go.").content == expected
    assert registry.build_count == 0


@pytest.mark.parametrize(
    ("variable", "default"),
    [
        (engine_module.BUDGET_ENV_VAR, registry_module.DEFAULT_MAX_BYTES),
        (engine_module.PREFIX_BUDGET_ENV_VAR, engine_module.DEFAULT_PREFIX_BYTES),
    ],
)
def test_the_default_engines_budgets_come_from_the_environment(monkeypatch, variable, default):
    monkeypatch.setenv(variable, "12345")
    assert engine_module._bytes_from_environment(variable, default) == 12345
    monkeypatch.delenv(variable)
    assert engine_module._bytes_from_environment(variable, default) == default
    monkeypatch.setenv(variable, "two gigabytes")
    with pytest.raises(ValueError, match=f"{variable} must be a whole number of bytes"):
        engine_module._bytes_from_environment(variable, default)


def test_compiled_decode_for_the_default_engine_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(engine_module.COMPILE_ENV_VAR, raising=False)
    assert engine_module._compile_from_environment() is False
    monkeypatch.setenv(engine_module.COMPILE_ENV_VAR, "1")
    assert engine_module._compile_from_environment() is True
    assert Engine(compile_decode=True).schedulers.compile_decode is True
    monkeypatch.setenv(engine_module.COMPILE_ENV_VAR, "yes please")
    with pytest.raises(ValueError, match=r"must be 1 .* or 0"):
        engine_module._compile_from_environment()
