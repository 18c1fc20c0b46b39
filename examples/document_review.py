"""Document review with LangGraph: planner, parallel specialists, critic and summarizer over one pool.

    python examples/document_review.py                         # the bundled sample document
    python examples/document_review.py --document report.md --roles legal finance risk --max-tokens 64

Runs graphs/document_review.py on the embedded SmolLM2-135M-Instruct. The document is prefilled once
into a compressed pool; every role reads it from there (cache_read >= the pool's tokens). Prints the
plan, each finding, the critique, the summary, and how many pools this process built.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `graphs`

from graphs.document_review import DEFAULT_ROLES, build_graph
from polykv_agents import default_engine


def sample_document() -> str:
    """The bundled sample document (a water utility's annual review)."""
    return resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")


def main(document: str | None = None, roles: list[str] | None = None, max_tokens: int = 96) -> dict:
    """Review ``document`` (default: the bundled sample) with ``roles``; return the final state."""
    review = build_graph(max_tokens=max_tokens)
    builds_before = default_engine().pools.build_count
    started = time.perf_counter()
    state = review.invoke({"document": document or sample_document(), "roles": list(roles or DEFAULT_ROLES)})
    seconds = time.perf_counter() - started

    pool = state["pool"]  # the handle, as plain JSON
    print(
        f"pool {pool['digest'][:12]}: {pool['num_tokens']} document tokens, {pool['nbytes'] / 2**20:.2f} MiB compressed"
    )
    plan = "\n".join(f"- {entry['role']}: {entry['focus']}" for entry in state["plan"])
    print(f"\n[plan] (typed, from structured output)\n{plan}")
    for finding in state["findings"]:
        print(f"\n[{finding['role']}] (cache_read={finding['cache_read']})\n{finding['text'].strip()}")
    print(f"\n[critique]\n{state['critique'].strip()}")
    print(f"\n[summary]\n{state['summary'].strip()}")
    builds = default_engine().pools.build_count - builds_before
    print(f"\npools built in this run: {builds}; {len(state['messages'])} model calls; {seconds:.1f} s")
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--document", type=Path, help="a text file to review (default: the bundled sample)")
    parser.add_argument("--roles", nargs="+", help=f"specialist roles, at most 15 (default: {' '.join(DEFAULT_ROLES)})")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    args = parser.parse_args()
    text = args.document.read_text(encoding="utf-8") if args.document else None
    main(text, args.roles, args.max_tokens)
