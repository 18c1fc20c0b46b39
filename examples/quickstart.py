"""Quick start: one document, one compressed pool, three agents.

    python examples/quickstart.py

Loads the embedded SmolLM2-135M-Instruct, prefills the bundled sample document once into a
SharedKVPool (int8 keys, 3-bit TurboQuant values), and lets three roles answer from it.
"""

from __future__ import annotations

import argparse
from importlib import resources

from polykv_agents import PooledAgent, SharedKVPool, load_model

ROLES = {
    "planner": ("You plan the Board's next steps.", "Which four measures does the review recommend?"),
    "critic": ("You look for weaknesses.", "Why did non-revenue water rise in 2025?"),
    "summarizer": ("You write one-sentence summaries.", "Summarise the year in one sentence."),
}


def main(max_new_tokens: int = 64) -> dict[str, str]:
    model, tokenizer = load_model()
    document = resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    pool = SharedKVPool.prefill(
        model,
        tokenizer,
        [
            {"role": "system", "content": "You are one of several analysts sharing the document below."},
            {"role": "user", "content": document},
        ],
    )
    print(pool)

    answers = {}
    for name, (role_prompt, question) in ROLES.items():
        agent = PooledAgent(pool, model, tokenizer, system_prompt=role_prompt, name=name)
        print(f"\n[{name}] {question}\n", end="", flush=True)
        pieces = []
        for piece in agent.stream(question, max_new_tokens=max_new_tokens):
            print(piece, end="", flush=True)
            pieces.append(piece)
        answers[name] = "".join(pieces)
        print()

    report = pool.memory_report(n_agents=len(ROLES))
    print()
    for label, nbytes in report.rows():
        print(f"{label:<45} {nbytes / 2**20:8.2f} MiB")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    main(parser.parse_args().max_new_tokens)
