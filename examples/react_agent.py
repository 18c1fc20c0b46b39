"""A ReAct-style agent (LangChain's ``create_agent``) with two small tools, reading its document from one pool.

    python examples/react_agent.py                                   # the bundled sample document
    python examples/react_agent.py --document report.md --question "What changed in 2025?" --max-tokens 64

Runs graphs/document_agent.py on the embedded SmolLM2-135M-Instruct: the document is prefilled once
into a compressed pool, then the agent loops model -> tools -> model, every model call reading the
document from the pool (``cache_read``), until it answers or reaches its limit of model calls. Each
tool call is decoded under a grammar, so it always parses. Prints every step, then how many pools
this process built.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `graphs`

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from graphs.document_agent import MAX_MODEL_CALLS, build_graph
from polykv_agents import default_engine

DEFAULT_QUESTION = "What does the review say about drought?"


def sample_document() -> str:
    """The bundled sample document (a water utility's annual review)."""
    return resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")


def describe(message) -> str:
    """One step of the run as a line or two."""
    if isinstance(message, AIMessage) and message.tool_calls:
        calls = ", ".join(f"{call['name']}({call['args']})" for call in message.tool_calls)
        read = message.usage_metadata["input_token_details"]["cache_read"]
        return f"[model] calls {calls} (cache_read={read})"
    if isinstance(message, AIMessage):
        read = (message.usage_metadata or {}).get("input_token_details", {}).get("cache_read", 0)
        return f"[model] answers (cache_read={read}):\n{message.text.strip()}"
    if isinstance(message, ToolMessage):
        return f"[tool {message.name}] {message.text.strip()[:300]}"
    return f"[{message.type}] {message.text.strip()}"


def main(
    question: str = DEFAULT_QUESTION,
    document: str | None = None,
    max_tokens: int = 96,
    max_model_calls: int = MAX_MODEL_CALLS,
) -> dict:
    """Ask the agent ``question`` about ``document`` (default: the bundled sample); return the final state."""
    agent = build_graph(max_tokens=max_tokens, max_model_calls=max_model_calls)
    builds_before = default_engine().pools.build_count
    started = time.perf_counter()
    state = agent.invoke({"messages": [HumanMessage(question)], "document": document or sample_document()})
    seconds = time.perf_counter() - started

    pool = state["pool"]  # the handle, as plain JSON
    print(
        f"pool {pool['digest'][:12]}: {pool['num_tokens']} document tokens, {pool['nbytes'] / 2**20:.2f} MiB compressed"
    )
    for message in state["messages"]:
        print(describe(message))
    model_calls = sum(isinstance(m, AIMessage) and m.usage_metadata is not None for m in state["messages"])
    builds = default_engine().pools.build_count - builds_before
    print(f"\npools built in this run: {builds}; {model_calls} model calls; {seconds:.1f} s")
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default=DEFAULT_QUESTION, help="what to ask about the document")
    parser.add_argument("--document", type=Path, help="a text file (default: the bundled sample)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per model call")
    parser.add_argument("--max-model-calls", type=int, default=MAX_MODEL_CALLS, help="model calls per run")
    args = parser.parse_args()
    text = args.document.read_text(encoding="utf-8") if args.document else None
    main(args.question, text, args.max_tokens, args.max_model_calls)
