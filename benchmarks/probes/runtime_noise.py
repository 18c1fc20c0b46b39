"""Probe: how far apart are two `bench tasks` runs that differ only in how the answers were decoded?

The ``private`` runtime decodes each answer over a cache of its own through the model's own attention; the
``decompressed`` runtime (the graphs' agents') attends to the shared pool and the call's own tokens separately and
merges the two softmaxes. In exact arithmetic they pick the same greedy tokens (in fp32 they do, on every answer
checked); in bf16 they round in another order, and a 135M model's greedy answer often turns on a near tie. How much
a config's score moves by that rounding alone is the floor under every config-vs-full delta of `bench tasks`.

Give it two results of the same model, seed, tasks, configs and items (say ``--runtime private`` and the default):

    python benchmarks/probes/runtime_noise.py A/tasks.json B/tasks.json

Per context and config: the paired score change from A to B (points, 95% CI over items), the items whose score
changed, and the items whose answer is worded differently.

Measured 2026-12-03 on this project's 2-core machine (one torch thread each), SmolLM2-135M-Instruct in bf16, the
200 items at 1,024 tokens of the committed run, answered by ``--runtime private`` (A: the result committed before
dd45ee8, ``git show 692cb0c:benchmarks/results/tasks.json``) and by the default runtime (B: the one after):

  private -> decompressed, SmolLM2-135M-Instruct
   1,024  full                    27.8 ->  27.4   -0.4 (-1.4 to +0.6)  score moved on   2 of 200, answer reworded on  41
   1,024  default                 26.5 ->  26.0   -0.5 (-1.5 to +0.5)  score moved on   1 of 200, answer reworded on  56
   1,024  paper                   26.2 ->  26.6   +0.4 (-0.6 to +1.4)  score moved on   2 of 200, answer reworded on  46
   1,024  max                     24.6 ->  24.1   -0.5 (-1.5 to +0.5)  score moved on   1 of 200, answer reworded on  43
   1,024  keys tq4, values tq3    24.8 ->  24.9   +0.1 (-1.1 to +1.4)  score moved on   2 of 200, answer reworded on  57

- Rounding alone rewords a quarter of the answers but moves the score of 1 or 2 items in 200 per config. The
  compressed configs move it on 14 to 20 items against each other (`bench tasks`' pairwise table), so what
  those deltas measure is compression.
- In fp32 the two runtimes gave identical answers on all 12 checked (4 items at 2,048 tokens x full, default,
  max), among them the items whose bf16 answers differed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from polykv_agents.bench.stats import mean_interval
from polykv_agents.bench.tasks import TasksResult


def compare(first: TasksResult, second: TasksResult) -> list[str]:
    """One line per (context, config) the two results share."""
    others = {(a.context, a.item, a.config): a for a in second.answers}
    pairs: dict[tuple[int, str], list[tuple[float, float, bool]]] = {}
    for a in first.answers:
        if (b := others.get((a.context, a.item, a.config))) is not None:
            pairs.setdefault((a.context, a.config), []).append((a.score, b.score, a.answer != b.answer))
    lines = []
    for (context, config), scored in pairs.items():
        change = mean_interval([100 * (b - a) for a, b, _ in scored])
        moved = sum(1 for a, b, _ in scored if a != b)
        reworded = sum(1 for *_, differs in scored if differs)
        lines.append(
            f"{context:>6,}  {config:<22} {100 * sum(a for a, *_ in scored) / len(scored):5.1f} -> "
            f"{100 * sum(b for _, b, _ in scored) / len(scored):5.1f}  {change.mean:+5.1f} "
            f"({change.low:+.1f} to {change.high:+.1f})  score moved on {moved:>3} of {len(scored)}, "
            f"answer reworded on {reworded:>3}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="a `bench tasks` result JSON")
    parser.add_argument("second", type=Path, help="another one, of the same items")
    args = parser.parse_args()
    first, second = (TasksResult.model_validate_json(p.read_text(encoding="utf-8")) for p in (args.first, args.second))
    print(f"{first.options.get('runtime')} -> {second.options.get('runtime')}, {first.run_info.model}")
    print("\n".join(compare(first, second)))


if __name__ == "__main__":
    main()
