"""Role lists and per-call measurements shared by the LangGraph workflows in graphs/.

Kept in the package (not in graphs/) because ``langgraph build`` installs the package and loads each
graph file on its own: both graphs import these from here instead of repeating them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage
from langchain_core.runnables import Runnable

from polykv_agents.chat.chat_model import ChatPolyKV

if TYPE_CHECKING:
    from polykv_agents.distributed import RayCluster

RAY_ADDRESS_VARIABLE = "POLYKV_RAY_ADDRESS"
"""Environment variable that sends the exported graphs' role calls to a Ray cluster (see :func:`cluster_from_env`)."""

MAX_ROLES = 15
"""Most parallel roles one run accepts: 15 parallel calls over one pool is the bound the tests cover (15 branches
equal to 15 sequential greedy calls) and ``pool.memory_report(n_agents=15)`` measures. Each parallel role
adds a row to the decode batch with a cache of its own (its prompt and answer, about 45 KiB per token for
SmolLM2-135M in fp32; with ``ChatPolyKV(runtime="private")`` the whole decoded document too). More is refused."""


def with_parallel_roles(graph: Runnable, roles: int = MAX_ROLES) -> Runnable:
    """``graph`` set to run ``roles`` parallel branches (``Send`` fan-out) at once, plus the node that fans out.

    Pooled role calls share one batched decode step only while they run at the same time, and LangGraph runs a
    step's parallel branches on a thread pool of ``min(32, cores + 4)`` threads unless ``max_concurrency`` says
    otherwise: 6 on a 2-core machine, so 15 roles would decode as batches of at most 6. Use it on your own
    graphs that fan out over one pool::

        graph = with_parallel_roles(builder.compile(checkpointer=saver), roles=len(ROLES))
    """
    if roles < 1:
        msg = f"roles must be at least 1, got {roles}"
        raise ValueError(msg)
    return graph.with_config(max_concurrency=roles + 1)


def check_roles(roles: Sequence[str] | None, *, default: Sequence[str]) -> list[str]:
    """The role list of a run: ``default`` when ``None``, else 1 to MAX_ROLES distinct, non-empty names.

    Raises:
        TypeError: ``roles`` is a string or holds something other than strings.
        ValueError: Empty, more than MAX_ROLES, a blank name, or a name given twice.
    """
    if roles is None:
        return list(default)
    if isinstance(roles, str) or not isinstance(roles, Sequence):
        msg = f"roles must be a list of role names, got {type(roles).__name__}; e.g. ['legal', 'finance']"
        raise TypeError(msg)
    if not all(isinstance(role, str) for role in roles):
        msg = f"roles must hold strings, got {[type(role).__name__ for role in roles]}"
        raise TypeError(msg)
    names = [role.strip() for role in roles]
    if not names:
        msg = f"roles is empty; pass 1 to {MAX_ROLES} role names, or leave roles out for {list(default)}"
        raise ValueError(msg)
    if len(names) > MAX_ROLES:
        msg = (
            f"{len(names)} roles given, but at most {MAX_ROLES} roles read one pool in parallel ({MAX_ROLES} is the "
            "tested bound, and each parallel role holds a cache of its own); split the roles over several runs"
        )
        raise ValueError(msg)
    if not all(names):
        msg = f"roles holds a blank name: {list(roles)!r}; give every role a name"
        raise ValueError(msg)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        msg = f"roles {duplicates} are given more than once; each role answers once per run"
        raise ValueError(msg)
    return names


def check_text(state: Mapping[str, Any], key: str) -> str:
    """``state[key]`` as non-blank text; a clear error otherwise."""
    value = state.get(key)
    if not isinstance(value, str) or not value.strip():
        msg = f"state[{key!r}] must be non-empty text, got {type(value).__name__} {value!r:.40}"
        raise ValueError(msg)
    return value


def cache_read(message: AIMessage) -> int:
    """Tokens the call read from the pool (0 for a call without one)."""
    usage = message.usage_metadata or {}
    return int(usage.get("input_token_details", {}).get("cache_read", 0))


def role_chat_model(
    chat: ChatPolyKV | None, max_tokens: int | None, *, default_max_tokens: int, cluster: RayCluster | None = None
) -> ChatPolyKV:
    """The chat model a graph's roles share: ``chat`` (or one of the embedded model, or of ``cluster``'s model when
    the roles run on a cluster), with ``max_tokens`` applied."""
    if chat is None:
        where = {} if cluster is None else {"model": cluster.model, "device": cluster.device}
        return ChatPolyKV(max_tokens=default_max_tokens if max_tokens is None else max_tokens, **where)
    return chat if max_tokens is None else chat.model_copy(update={"max_tokens": max_tokens})


def cluster_from_env() -> RayCluster | None:
    """The Ray cluster at ``$POLYKV_RAY_ADDRESS`` (``auto``: the one this machine belongs to), or ``None`` when the
    variable is unset. Connects on the first call, not here, so importing a graph file stays cheap."""
    address = os.environ.get(RAY_ADDRESS_VARIABLE)
    if not address:
        return None
    from polykv_agents.distributed import RayCluster  # Ray is an optional extra

    return RayCluster(address=address)
