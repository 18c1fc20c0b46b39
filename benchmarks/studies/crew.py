"""The studies' shared set-up: a pool over a pydoc document cut to a context length, and one agent per role."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.agents import role_prompts
from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.pool.shared_pool import SharedKVPool


def pool_and_roles(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, context_tokens: int, agents: int
) -> tuple[SharedKVPool, list[tuple[str, str]]]:
    """A pool of the first ``context_tokens`` tokens of a pydoc_data.topics document, and ``agents`` roles
    (system prompt, question)."""
    (pool,) = pydoc_pools(model, tokenizer, context_tokens, 1)
    return pool, role_prompts(agents)


def pydoc_pools(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, context_tokens: int, count: int
) -> list[SharedKVPool]:
    """Pools of the first ``context_tokens`` tokens of ``count`` distinct pydoc_data.topics documents."""
    pools = []
    for document in pydoc_documents(count, chars_per_document=8 * context_tokens):
        ids = tokenizer(document, return_tensors="pt").input_ids[0][:context_tokens]
        pools.append(run_on_compute_thread(SharedKVPool.prefill_tokens, model, tokenizer, ids))
    return pools


def pooled_agents(pool, model, tokenizer, roles: list[tuple[str, str]], engine) -> list[PooledAgent]:
    """One agent per role over ``pool``, on ``engine``."""
    return [PooledAgent(pool, model, tokenizer, system_prompt=role, engine=engine) for role, _ in roles]
