"""Stream tokens from parallel role nodes as they arrive, labelled by node and role.

    python examples/stream_parallel_nodes.py
    python examples/stream_parallel_nodes.py --roles analyst skeptic economist --max-tokens 32

Runs graphs/role_swarm.py with ``stream_mode="messages"``: LangGraph hands over each token chunk with
metadata naming the node that produced it (``langgraph_node``) and the branch's task namespace
(``langgraph_checkpoint_ns``); the role nodes also tag their calls with ``agent_role``. Tokens of the
parallel branches interleave; each run of tokens is prefixed with the node and role it came from, and
the text assembled per node and role is printed at the end.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from langchain_core.messages import AIMessageChunk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `graphs`

from graphs.role_swarm import build_graph

QUESTION = "What is the biggest problem the document describes?"


def main(
    roles: list[str] | None = None, max_tokens: int = 32, document: str | None = None, question: str = QUESTION
) -> dict[str, str]:
    """Stream one role-swarm run; return the streamed text per ``node/role`` label."""
    swarm = build_graph(max_tokens=max_tokens)
    text = document or resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    inputs = {"document": text, "question": question, "roles": list(roles or ["analyst", "skeptic", "economist"])}
    streamed: dict[str, str] = {}
    last_label = None
    for chunk, metadata in swarm.stream(inputs, stream_mode="messages"):
        if not isinstance(chunk, AIMessageChunk) or not chunk.text:
            continue  # the last chunk of each call carries only usage metadata
        label = f"{metadata['langgraph_node']}/{metadata.get('agent_role', '?')}"
        if label != last_label:  # parallel branches interleave: start a new labelled line
            print(f"\n[{label}] ", end="")
            last_label = label
        print(chunk.text, end="", flush=True)
        streamed[label] = streamed.get(label, "") + chunk.text
    print("\n\nassembled per node/role:")
    for label, text in streamed.items():
        print(f"  {label}: {text.strip()}")
    return streamed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roles", nargs="+", help="roles, at most 15 (default: analyst skeptic economist)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args()
    main(args.roles, args.max_tokens, question=args.question)
