"""Probe: task scores with quantized weights against the native model's, item by item, from two `bench tasks` runs.

The two runs must ask the same questions (same model, seed, contexts, items, tasks, configs and runtime) and differ
only in ``--weights``: each (context, item, config) is then one paired sample, and the comparison says how many
items rose and fell, with a bootstrap interval of the mean change and a sign test
(:func:`~polykv_agents.bench.stats.paired_comparison`). For example:

    python -m benchmarks tasks --context 2048 --items 70 --config default --out R/native
    python -m benchmarks tasks --context 2048 --items 70 --config default --weights int8 --out R/int8
    python -m benchmarks.probes.weights_tasks R/native/tasks.json R/int8/tasks.json --out R/weights_tasks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from polykv_agents.bench.journal import differing_options
from polykv_agents.bench.stats import paired_comparison
from polykv_agents.bench.tasks import DEFAULTS_OF_LATER_OPTIONS, TasksResult


def read(path: Path) -> TasksResult:
    return TasksResult.model_validate_json(path.read_text(encoding="utf-8"))


def compare(native: TasksResult, quantized: TasksResult) -> dict[str, Any]:
    """Per config, the quantized run's scores against the native run's on the same items."""
    native_options = {**DEFAULTS_OF_LATER_OPTIONS, **native.options}
    quantized_options = {**DEFAULTS_OF_LATER_OPTIONS, **quantized.options}
    changed = differing_options(native_options, quantized_options)
    if changed != ["weights"]:
        msg = f"the two runs must differ in --weights only; they differ in: {', '.join(changed) or 'nothing'}"
        raise ValueError(msg)
    answers = {(a.context, a.item, a.config): a for a in native.answers}
    by_config: dict[str, list[tuple[float, float]]] = {}
    same_text: dict[str, int] = {}
    for answer in quantized.answers:
        theirs = answers[(answer.context, answer.item, answer.config)]
        by_config.setdefault(answer.config, []).append((theirs.score, answer.score))
        same_text[answer.config] = same_text.get(answer.config, 0) + (theirs.answer == answer.answer)
    rows = {}
    for config, pairs in by_config.items():
        comparison = paired_comparison([q - n for n, q in pairs])
        rows[config] = {
            "native_score": 100 * statistics.fmean(n for n, _ in pairs),
            "quantized_score": 100 * statistics.fmean(q for _, q in pairs),
            "same_text": same_text[config],
            "change_points": comparison.model_dump(exclude={"confidence", "resamples"})
            | {key: 100 * getattr(comparison, key) for key in ("mean", "low", "high")},
        }
    return {"model": native.run_info.model, "dtype": native.run_info.dtype,
            "weights": quantized_options["weights"], "native_commit": native.run_info.git_commit,
            "quantized_commit": quantized.run_info.git_commit, "machine": native.run_info.cpu,
            "options": {k: v for k, v in native_options.items() if k != "weights"}, "configs": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("native", type=Path, help="tasks.json of the native run")
    parser.add_argument("quantized", type=Path, help="tasks.json of the run with --weights")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = compare(read(args.native), read(args.quantized))
    for config, row in result["configs"].items():
        change = row["change_points"]
        print(f"{config:>10}: native {row['native_score']:.1f}, {result['weights']} {row['quantized_score']:.1f}, "
              f"change {change['mean']:+.1f} [{change['low']:+.1f}, {change['high']:+.1f}] points over "
              f"{change['n']} items ({change['better']} rose, {change['worse']} fell, "
              f"p={change['sign_test_p']:.2f}); the same text in {row['same_text']} answers")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
