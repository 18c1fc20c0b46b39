"""Two documents, each prefilled once into a pool of its own, read together by one agent.

    python examples/two_documents.py

A library of pools (one per document, saved or built once) answers questions about any combination of them:
``compose_pools`` moves the second document's keys to where it now sits (after the first) and recomputes its
first 5% in that context, instead of prefilling both documents again. It is an approximation, measured in
docs/RUNTIME.md ("Several documents in one pool"). Here the two documents are the two halves of the bundled
operations review, so the agent's answer needs both.
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

from polykv_agents import PooledAgent, SharedKVPool, compose_pools, load_model

QUESTION = "What was the surplus, and how many hidden leaks did the sensors find?"


def main(max_new_tokens: int = 48) -> str:
    model, tokenizer = load_model()
    review = resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    middle = review.index("## 3.")
    first, second = review[:middle], review[middle:]
    pools = [SharedKVPool.prefill(model, tokenizer, text) for text in (first, second)]  # each once, on its own
    start = time.perf_counter()
    both = compose_pools(model, tokenizer, pools)  # the second's first 5% recomputed after the first
    print(f"composed {[p.num_tokens for p in pools]} tokens in {time.perf_counter() - start:.2f} s: {both}")
    print(f"composition: {dict(both.composition)}")
    agent = PooledAgent(both, model, tokenizer, system_prompt="You answer from the document.")
    answer = agent.generate(QUESTION, max_new_tokens=max_new_tokens)
    print(f"\n{QUESTION}\n{answer}")
    return answer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    main(parser.parse_args().max_new_tokens)
