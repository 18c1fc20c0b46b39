"""Time to first token: the one definition every suite uses.

- **re-prefill**: what a plain local chat model does on every call. The document's tokens and the
  agent's prompt are prefilled together into a fresh cache, with this project's own chunked prefill
  (its fastest path for long inputs), and the first token is picked. The prompt is the pooled agent's
  own, so both sides read exactly the same tokens.
- **pool, cold**: the first call of an engine over a pool: a fresh engine, so a fresh scheduler
  decodes the shared prefix from the pool's codes inside the timed call, then prefills the prompt.
  What the first role call of a workflow run pays.
- **pool, warm**: a later call, while the decoded prefix is resident (the scheduler of a running
  workflow); only the prompt is prefilled.

These figures are the pool's alone: the suites' engines reuse nothing beyond it (``max_prefix_bytes=0``),
or a warm call that repeats a prompt would read it from the prefix tree and prefill one token. What that
reuse saves is measured by the repository's reuse study (``python -m benchmarks reuse``).

Each is one interval, from the call to its first token. :func:`time_to_first_token` times it around a token
stream a suite asks for itself (a pooled agent's call, a scheduler request); :func:`reported_ttft` reads the
same interval from the runtime's own stamps for a chat call, whose reply comes only once its whole answer is
decoded (``invoke``, or a call a workflow makes), so no clock around it can see the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.engine import Engine
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.backend import Runtime
from polykv_agents.sampling.settings import GenerationSettings

if TYPE_CHECKING:
    from langchain_core.messages import BaseMessage

_FIRST_TOKEN = GenerationSettings(max_new_tokens=1)


def time_to_first_token(call: Callable[[], Iterable[Any]]) -> tuple[float, float]:
    """``(asked, seconds)``: when ``call`` was made (``time.perf_counter``) and the seconds from then to the first
    token of the stream it returns (or to its end, for an answer that ends at once). The rest of the stream is
    read untimed, so that the call is over before the next measurement."""
    asked = time.perf_counter()
    stream = iter(call())
    next(stream, None)
    seconds = time.perf_counter() - asked
    for _ in stream:
        pass
    return asked, seconds


def reported_ttft(reply: BaseMessage) -> float:
    """Seconds from a chat call to its first token as the runtime stamped them: its ``queue_s`` (waiting for a
    batch row) plus its ``prefill_s`` (its prompt, composing moved blocks included), from the reply's metadata."""
    meta = reply.response_metadata
    return (meta["queue_s"] or 0.0) + (meta["prefill_s"] or 0.0)


def _first_token_seconds(agent: PooledAgent, question: str) -> float:
    return time_to_first_token(lambda: agent.generate_ids(question, _FIRST_TOKEN))[1]


def ttft_pool_cold(
    pool: SharedKVPool, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, system_prompt: str,
    question: str, *, runtime: Runtime = "auto",
) -> float:  # fmt: skip
    """Seconds to the first token of the first call of a fresh engine (the prefix decode included)."""
    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
    try:
        agent = PooledAgent(pool, model, tokenizer, system_prompt=system_prompt, runtime=runtime, engine=engine)
        return _first_token_seconds(agent, question)
    finally:
        engine.close()


def ttft_pool_warm(agent: PooledAgent, question: str) -> float:
    """Seconds to the first token of a call while the agent's decoded prefix is resident: one untimed call
    first makes it so (its engine must keep idle schedulers for as long as the measurement lasts)."""
    _first_token_seconds(agent, question)
    return _first_token_seconds(agent, question)


@torch.inference_mode()
def ttft_reprefill(model: PreTrainedModel, pool: SharedKVPool, prompt: torch.Tensor) -> float:
    """Seconds to the first token when document + ``prompt [n]`` are prefilled again into a fresh cache."""
    ids = torch.cat([pool.token_ids, prompt])
    started = time.perf_counter()
    _, logits = prefill_cache(model, ids)
    run_on_compute_thread(lambda: int(logits.argmax()))
    return time.perf_counter() - started
