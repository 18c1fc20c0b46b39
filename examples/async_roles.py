"""Async use: several roles with ``await chat.abatch(...)``, then a whole graph with ``await graph.ainvoke(...)``.

    python examples/async_roles.py
    python examples/async_roles.py --roles analyst skeptic lawyer --max-tokens 32

1. The prefetch node builds the sample document's pool (on a worker thread: prefilling blocks), and
   ``prefetch.pooled_chat(state)`` gives the chat model bound to it; ``abatch`` answers one question
   as several roles concurrently (each call decodes on a thread of its own, the event loop stays free).
2. ``graphs/role_swarm.py`` runs the same roles with ``ainvoke``; its prefetch node finds the pool
   already built, so this process still built exactly one pool.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `graphs`

from graphs.role_swarm import build_graph, role_messages
from polykv_agents import ChatPolyKV, default_engine
from polykv_agents.graph.prefetch import PrefetchDocument

QUESTION = "Who should act first on the problems the document describes?"


async def run(roles: list[str], max_tokens: int, document: str, question: str) -> dict:
    builds_before = default_engine().pools.build_count
    prefetch = PrefetchDocument(ChatPolyKV(max_tokens=max_tokens))
    state = {"document": document}
    state |= await asyncio.to_thread(prefetch, state)  # {"pool": the handle, as plain JSON}
    chat = prefetch.pooled_chat(state)
    replies = await chat.abatch([role_messages(role, question) for role in roles])
    for role, reply in zip(roles, replies, strict=True):
        cached = reply.usage_metadata["input_token_details"]["cache_read"]
        print(f"[abatch/{role}] (cache_read={cached}) {reply.text.strip()}")

    swarm = build_graph(chat=prefetch.chat)
    result = await swarm.ainvoke({"document": document, "question": question, "roles": roles})
    for answer in result["answers"]:
        print(f"[ainvoke/{answer['role']}] (cache_read={answer['cache_read']}) {answer['text'].strip()}")
    print(f"[ainvoke/aggregate] {result['answer'].strip()}")
    builds = default_engine().pools.build_count - builds_before
    print(f"pools built: {builds} (the graph reused the pool the batch built)")
    return {"batch": {role: reply.text for role, reply in zip(roles, replies, strict=True)}, "graph": result}


def main(
    roles: list[str] | None = None, max_tokens: int = 32, document: str | None = None, question: str = QUESTION
) -> dict:
    """Run both parts; return ``{"batch": {role: text}, "graph": final role-swarm state}``."""
    text = document or resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    return asyncio.run(run(list(roles or ["analyst", "skeptic", "economist"]), max_tokens, text, question))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roles", nargs="+", help="roles, at most 15 (default: analyst skeptic economist)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args()
    main(args.roles, args.max_tokens, question=args.question)
