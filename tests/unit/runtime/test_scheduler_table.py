"""SchedulerTable: one scheduler per (model, pool, residency), given each request's own grammar state."""

from __future__ import annotations

import pytest
from tiny_models import tiny_sensitive_llama

from polykv_agents import SharedKVPool
from polykv_agents.runtime import scheduler_table
from polykv_agents.runtime.request import DecodeRequest
from polykv_agents.runtime.scheduler_table import SchedulerTable
from polykv_agents.sampling.settings import GenerationSettings


@pytest.fixture(scope="module")
def model():
    return tiny_sensitive_llama()


@pytest.fixture(scope="module")
def pool(model, tiny_tok):
    return SharedKVPool.prefill(model, tiny_tok, "A document for the scheduler table alone.")


def test_each_residency_gets_a_scheduler_of_its_own(model, tiny_tok, pool):
    table = SchedulerTable(idle_seconds=None)
    compressed = table.scheduler_for(model, tiny_tok, pool, "compressed")
    decompressed = table.scheduler_for(model, tiny_tok, pool, "decompressed")
    assert (compressed.prefix.residency, decompressed.prefix.residency) == ("compressed", "decompressed")
    assert table.scheduler_for(model, tiny_tok, pool, "compressed") is compressed
    assert len(table) == 2 and repr(table) == "SchedulerTable(live=2, idle_seconds=None)"
    table.close()
    assert len(table) == 0


class _FailingGrammar:
    """A grammar state that fails when first asked: proof that it reached the request's row."""

    def __getattr__(self, name: str):
        msg = f"this request's grammar state was asked for {name}"
        raise RuntimeError(msg)


def test_the_request_s_grammar_state_is_built_for_it_and_reaches_its_row(model, tiny_tok, pool, monkeypatch):
    settings = GenerationSettings(max_new_tokens=4)
    request = DecodeRequest(model, tiny_tok, pool.token_ids[:3], settings, pool=pool)
    built = []

    def token_constraint(*args):
        built.append(args)
        return _FailingGrammar()

    monkeypatch.setattr(scheduler_table, "token_constraint", token_constraint)
    table = SchedulerTable(idle_seconds=None)
    with pytest.raises(RuntimeError, match="grammar state was asked"):
        list(table.submit(request, "decompressed", 4))
    assert built == [(model, tiny_tok, settings)]
    table.close()
