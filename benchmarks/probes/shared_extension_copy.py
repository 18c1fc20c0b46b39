"""Probe: what copying stored prefixes into each agent's row costs in the 15-role review, i.e. the most that a
third cascade level ([pool] [shared extension] [own suffix], the extension read in place) could save.

With exact reuse on (the default engine), a call whose prompt starts with tokens an earlier call stored copies
their keys and values from the pool's prefix tree into its own suffix row (``SuffixCache.load_row``) and
prefills only the rest. This probe runs the review graph of ``bench graph_e2e`` (pinned plan, 32-token answers,
EOS ignored, the default chat model, bf16, eager steps) and times every such copy, per stage:

- calls that copied, tokens copied per call (median), bytes copied (sum of the copied tensors' ``nbytes``);
- bytes of the distinct stored runs those copies came from: what one in-place copy would hold;
- seconds spent copying, against the stage's wall seconds;
- and, per review, how many bytes the prefix tree grew by (its nodes are kept decoded, in the model's dtype).

    python benchmarks/probes/shared_extension_copy.py --tokens 4096 --documents 3

One warm-up run on a 256-token document first; each measured document is a different pydoc_data.topics text
(the independent samples).

Measured 2026-12-03 on this project's 2-core machine (SmolLM2-135M-Instruct, bf16, default compression),
``--tokens 4096 --documents 3``; reviews took 36-42 s, and the prefix tree grew by about 50 MiB per review:

  stage       calls that copied  tokens per call  MiB copied  MiB distinct  copying ms  stage s
  specialist  13                 3                0.97        0.33          41.5        8.38
  critic      1                  6                0.13        0.13          2.2         4.83
  summarizer  1                  595              13.07       13.07         2.3         2.76

docs/RUNTIME.md ("Why stored prefixes are copied into rows") draws the conclusion: reading them in place
would save 0.6 MiB and under 50 ms of a 40 s review.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` is not installed

from benchmarks.studies.graph_e2e import EXTRA_ROLES, STAGES, _document, graphs_under_test, load_workflow, run_graph
from benchmarks.studies.workflows import LANGGRAPH_JSON
from polykv_agents.engine import load_model
from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.runtime.suffix_cache import SuffixCache


class CopyLog:
    """Wraps ``SuffixCache.load_row`` to record each copy: tokens, bytes, seconds and the stored tensors' ids."""

    def __init__(self) -> None:
        self.copies: list[dict] = []
        self._load_row = SuffixCache.load_row
        log = self

        def load_row(cache, row, layers):
            started = time.perf_counter()
            log._load_row(cache, row, layers)
            log.copies.append({
                "tokens": int(layers[0][0].shape[1]) if layers else 0,
                "bytes": sum(k.nbytes + v.nbytes for k, v in layers),
                "seconds": time.perf_counter() - started,
                "at": started,
                # where the copy came from: the first layer's keys' storage and their first element
                "source": (layers[0][0].untyped_storage().data_ptr(), layers[0][0].storage_offset(),
                           int(layers[0][0].shape[1])) if layers else None,
            })  # fmt: skip

        SuffixCache.load_row = load_row

    def take(self) -> list[dict]:
        copies, self.copies = self.copies, []
        return copies


def by_stage(copies: list[dict], started: float, stage_ends: dict[str, float]) -> dict[str, list[dict]]:
    """Each copy under the stage running when it was made: the first whose end (seconds after ``started``) is
    after it. A copy is made at a call's admission, so it falls inside its own stage."""
    out: dict[str, list[dict]] = {stage: [] for stage in stage_ends}
    for copy in copies:
        stage = next((s for s, end in stage_ends.items() if copy["at"] - started <= end), "after")
        out.setdefault(stage, []).append(copy)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--roles", type=int, default=15)
    args = parser.parse_args()

    workflow = load_workflow("document_review", LANGGRAPH_JSON)
    _, tokenizer = load_model(None)
    roles = [*workflow.ROLE_PROMPTS, *EXTRA_ROLES][: args.roles]
    texts = pydoc_documents(args.documents + 1, chars_per_document=10 * args.tokens)
    graph, engine = graphs_under_test(workflow, 32, "native", False)["pooled"]
    log = CopyLog()
    run_graph(graph, engine, _document(tokenizer, texts[0], 256, -1), roles[:3])  # warm-up
    log.take()
    per_stage: dict[str, list[dict]] = defaultdict(list)
    for run, text in enumerate(texts[1:]):
        tree_before = engine.schedulers.prefixes.nbytes
        started = time.perf_counter()
        result, calls = run_graph(graph, engine, _document(tokenizer, text, args.tokens, run), roles)
        copies = log.take()
        grown = (engine.schedulers.prefixes.nbytes - tree_before) / 2**20
        print(
            f"document {run}: wall {result.wall_s:.1f} s, {len(calls)} calls, {len(copies)} copies, "
            f"prefix tree grew by {grown:.1f} MiB",
            flush=True,
        )
        ends = dict(zip(STAGES, itertools.accumulate(result.stage_s[stage] for stage in STAGES), strict=True))
        for stage, stage_copies in by_stage(copies, started, ends).items():
            per_stage[stage].append({"copies": stage_copies, "stage_s": result.stage_s.get(stage, 0.0)})

    print(f"\n{args.tokens}-token documents, {args.roles} roles, {args.documents} documents (medians over them)")
    print("stage | calls that copied | tokens copied per call | MiB copied | MiB of distinct stored runs | "
          "copy ms (sum) | stage s")  # fmt: skip
    for stage, samples in per_stage.items():

        def med(figure, samples=samples) -> float:
            return statistics.median(figure(sample) for sample in samples)

        print(" | ".join([
            stage,
            f"{med(lambda s: sum(1 for c in s['copies'] if c['tokens'])):.0f}",
            f"{med(lambda s: statistics.median([c['tokens'] for c in s['copies']] or [0])):.0f}",
            f"{med(lambda s: sum(c['bytes'] for c in s['copies'])) / 2**20:.2f}",
            f"{med(lambda s: sum({c['source']: c['bytes'] for c in s['copies'] if c['source']}.values())) / 2**20:.2f}",
            f"{med(lambda s: sum(c['seconds'] for c in s['copies'])) * 1e3:.1f}",
            f"{med(lambda s: s['stage_s']):.2f}",
        ]))  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
