"""Probe: is a low full-precision task score at long contexts the model's, or this project's pipeline's?

`bench tasks`' reference is a full-precision pool read by a pooled agent. If something in the pool or the
runtime went wrong past some length, the reference would drop with it and every config-vs-full delta would
look harmless. This asks the same items twice in fp32, where the two must agree token for token: once through
the full-precision pool and the `private` runtime, once through the model's own ``generate`` over the whole
prompt (document, role and question as one sequence of token ids, no pool), and reports both scores.

    python benchmarks/probes/long_context_reference.py --context 4096 --items 7

Measured 2026-12-03 on this project's 2-core machine (one torch thread, two task runs beside it),
SmolLM2-135M-Instruct in fp32, the first 7 items at 4,096 tokens of the committed `bench tasks` run (seed 0,
one per task):

    0 niah_single         4025 tokens  same tokens: True   answer ' 11.'  expected ['5861836']
    1 niah_multikey       4056 tokens  same tokens: True   answer ' 4213720.'  expected ['4213720']
    2 niah_multivalue     4040 tokens  same tokens: True   answer ':\n\n1. 1\n2. 2\n3. 3\n4. 4\n5. 5\n...'
    3 variable_tracking   4046 tokens  same tokens: True   answer ' \n- 5.'  expected ['EMNST', 'LBAIO']
    4 common_words        3541 tokens  same tokens: True   answer '\n- "The"\n- "The"\n- "The"\n...'
    5 qa_squad            4229 tokens  same tokens: True   answer ' The movement called the Baltic movement was...'
    6 qa_hotpotqa         4256 tokens  same tokens: True   answer ' Philip Kraft lectured at the largest...'
  7 of 7 answers token for token the same; score through the pool 14.3, through generate 14.3

(Long answers cut here.) The pool and the runtime add nothing to SmolLM2's misses at 4,096 tokens: its own
``generate`` over the whole prompt makes the same ones, so the low full-precision score there (5.5 points over
200 items, against 16.0 at 2,048) is the 135M model's.
"""

from __future__ import annotations

import argparse
import random

import torch

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.tasks import FACT_FINDER_PROMPT, pool_document
from polykv_agents.config import CompressionConfig
from polykv_agents.engine import load_model
from polykv_agents.eval.tasks import TASKS, Haystack, string_match
from polykv_agents.pool.documents import tokenize_document
from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.sampling.settings import GenerationSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--items", type=int, default=7)
    parser.add_argument("--model", default=None, help="local GGUF or HF model; default: the embedded one")
    arguments = parser.parse_args()

    model, tokenizer = load_model(arguments.model, dtype=torch.float32)
    haystack, names = Haystack(tokenizer), list(TASKS)
    agree, scores = 0, {"pool": 0.0, "generate": 0.0}
    for index in range(arguments.items):
        task = names[index % len(names)]
        item = TASKS[task](haystack, arguments.context, random.Random(f"0-{arguments.context}-{index}"))
        token_ids, prefix_messages = tokenize_document(model, tokenizer, pool_document(tokenizer, item.document))
        pool = SharedKVPool.prefill_tokens(
            model, tokenizer, token_ids, config=CompressionConfig.full_precision(), prefix_messages=prefix_messages
        )
        agent = PooledAgent(pool, model, tokenizer, system_prompt=FACT_FINDER_PROMPT, runtime="private")
        settings = GenerationSettings(max_new_tokens=item.max_new_tokens)
        pooled = list(agent.generate_ids(item.question, settings, answer_prefix=item.answer_prefix))
        ids = torch.cat([token_ids, agent.prompt_ids(item.question, answer_prefix=item.answer_prefix)]).unsqueeze(0)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=item.max_new_tokens, do_sample=False
            )
        plain = out[0, ids.shape[-1] :].tolist()[: len(pooled)]
        same = pooled == plain
        agree += same
        answers = {"pool": tokenizer.decode(pooled, skip_special_tokens=True)}
        answers["generate"] = tokenizer.decode(plain, skip_special_tokens=True)
        for how, answer in answers.items():
            scores[how] += string_match(answer, item.answers, item.metric)
        print(f"{index:3d} {task:18s} {ids.shape[-1]:5d} tokens  same tokens: {same!s:5s}  "
              f"answer {answers['pool'][:60]!r}  expected {list(item.answers)[:2]}", flush=True)  # fmt: skip
    n = arguments.items
    print(f"{agree} of {n} answers token for token the same; score through the pool "
          f"{100 * scores['pool'] / n:.1f}, through generate {100 * scores['generate'] / n:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
