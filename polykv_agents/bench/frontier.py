"""``polykv-agents bench frontier``: how small a pool can get before perplexity moves, on any model.

Each config is a point (bytes, perplexity delta): the shipped presets, the smaller combinations of the
plain codecs, and the centered TurboQuant codec (attention sinks kept, channel mean removed, 8-bit
norms, keys compressed before RoPE) at 4, 3 and 2 bits. Sizes are the measured ``nbytes`` of real
pools; deltas come from the ablation's protocol (:func:`~polykv_agents.bench.ablation.run_ablation_suite`:
one prefill per document and context, every rotation seed, intervals over documents).

The summary names the Pareto frontier (no other config is both smaller and better), and the smallest
config within the bound the project holds a preset to: mean delta <= +1% at every context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import Field

from polykv_agents.bench.ablation import MAX_PRESET_BUDGET_PCT, pct_interval, run_ablation_suite
from polykv_agents.bench.output import Progress, SuiteResult
from polykv_agents.bench.suite import TableSuite, load_model_for
from polykv_agents.bench.sweep import SweepOptions
from polykv_agents.config import PRESETS, CodecConfig, CompressionConfig

TARGET_RATIO = 5.0
"""The compression the frontier is asked to reach within the bound (issue: a pool >= 5x smaller than fp16)."""


def ctq(bits: int, **options) -> CodecConfig:
    """Centered TurboQuant at ``bits`` (``before_rope=True`` for keys before RoPE), as the probes build it too."""
    return CodecConfig(method="centered_turboquant", bits=bits, **options)


def tq(bits: int) -> CodecConfig:
    """TurboQuant-MSE at ``bits``."""
    return CodecConfig(method="turboquant", bits=bits)


CONFIGS: dict[str, CompressionConfig] = {
    "default": CompressionConfig(),
    "keys tq4, values tq3": CompressionConfig(keys=tq(4), values=tq(3)),
    "keys tq4, values tq2": CompressionConfig(keys=tq(4), values=tq(2)),
    "keys tq3, values tq3": CompressionConfig(keys=tq(3), values=tq(3)),
    "keys ctq4 pre-RoPE, values ctq3": CompressionConfig(keys=ctq(4, before_rope=True), values=ctq(3)),
    "keys ctq4 pre-RoPE, values ctq2": CompressionConfig(keys=ctq(4, before_rope=True), values=ctq(2)),
    "keys ctq3 pre-RoPE, values ctq3": CompressionConfig(keys=ctq(3, before_rope=True), values=ctq(3)),
    "keys ctq3 pre-RoPE, values tq3": CompressionConfig(keys=ctq(3, before_rope=True), values=tq(3)),
    "keys ctq3 after RoPE, values ctq3": CompressionConfig(keys=ctq(3), values=ctq(3)),
    "keys ctq3 pre-RoPE, values ctq2": CompressionConfig(keys=ctq(3, before_rope=True), values=ctq(2)),
    "keys ctq2 pre-RoPE, values ctq2": CompressionConfig(keys=ctq(2, before_rope=True), values=ctq(2)),
}
"""Config name -> config at seed 0, from largest to smallest pool (roughly). Named by their codecs (``default``
aside), so that a name keeps meaning the same pool when a preset is re-decided."""


REFERENCE = "full"
"""The preset every compressed one is compared with: the uncompressed cache, always measured."""


def config_named(name: str) -> CompressionConfig:
    """A preset (``default``, ``max``, ...) or one of :data:`CONFIGS` by name."""
    return CompressionConfig.preset(name) if name in PRESETS else CONFIGS[name]


CONFIG_CHOICES = (
    f"choose among the presets {', '.join(p for p in PRESETS if p != REFERENCE)} or the frontier's configs: "
    f"{', '.join(map(repr, CONFIGS))}"
)
"""What a refused ``--config`` is told to choose from."""


def compressed_config_names(names: Iterable[str]) -> list[str]:
    """``names`` in order, repeats and ``full`` (the uncompressed reference, always measured) left out: the
    ``--config`` of the suites that compare pools with full precision. A ValueError lists the choices if a name
    is neither a preset nor one of :data:`CONFIGS`."""
    names = list(dict.fromkeys(name for name in names if name != REFERENCE))
    unknown = sorted(set(names) - set(PRESETS) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown compression config(s) {unknown}; {CONFIG_CHOICES}")
    return names


class FrontierOptions(SweepOptions):
    contexts: list[int] = Field(default=[2048], json_schema_extra={"flag": "--context"})
    """Context length (repeatable)."""
    seeds: int = Field(default=3, ge=1)
    """Rotation seeds per config."""


def pareto_front(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """Names of the points ``(name, ratio vs fp16, delta)`` that no other point beats on both: at least as
    small a pool with at most the same delta, better in one of the two. Sorted from largest pool to smallest."""
    front = [
        (name, ratio, delta)
        for name, ratio, delta in points
        if not any(r >= ratio and d <= delta and (r > ratio or d < delta) for other, r, d in points if other != name)
    ]
    return [name for name, _, _ in sorted(front, key=lambda p: p[1])]


def summarize(rows: Sequence[dict]) -> dict:
    """Per config: the worst mean delta over contexts and its smallest ratio; the front; the smallest in bound."""
    worst: dict[str, tuple[float, float]] = {}
    for row in rows:
        ratio, delta = worst.get(row["config"], (float("inf"), float("-inf")))
        worst[row["config"]] = (min(ratio, row["compression_ratio_vs_fp16"]), max(delta, row["delta_pct_mean"]))
    within = {name: ratio for name, (ratio, delta) in worst.items() if delta <= MAX_PRESET_BUDGET_PCT}
    smallest = max(within, key=within.get) if within else None
    return {
        "pareto_front": pareto_front([(name, ratio, delta) for name, (ratio, delta) in worst.items()]),
        "budget_pct": MAX_PRESET_BUDGET_PCT,
        "target_ratio": TARGET_RATIO,
        "smallest_within_budget": smallest,
        "smallest_within_budget_ratio": within.get(smallest),
        "target_met": bool(within) and max(within.values()) >= TARGET_RATIO,
    }


def _measure(options: FrontierOptions, progress: Progress) -> SuiteResult:
    from polykv_agents.eval.corpus import pydoc_documents

    texts = pydoc_documents(options.documents)
    model, tokenizer = load_model_for(options.model)
    ablation = run_ablation_suite(
        model,
        tokenizer,
        texts,
        contexts=options.contexts,
        seeds=list(range(options.seeds)),
        factors={name: ("frontier", config) for name, config in CONFIGS.items()},
        progress=progress,
    )
    rows = [{k: v for k, v in row.items() if k != "factor"} for row in ablation.rows]
    return SuiteResult(
        suite="frontier", info=ablation.info, settings=ablation.settings, rows=rows, summary=summarize(rows)
    )


def readme_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's frontier table: each config's size and worst-context delta, and whether it is on the front."""
    summary = result.summary
    front = set(summary["pareto_front"])
    lines = [
        "| config | codecs | x vs fp16 | bits per element | "
        + " | ".join(f"PPL delta at {c:,}, mean [95% CI]" for c in result.settings["contexts"])
        + " | on the front |",
        "|---|---|---:|---:|" + "---:|" * len(result.settings["contexts"]) + "---|",
    ]
    by_config: dict[str, dict[int, dict]] = {}
    for row in result.rows:
        by_config.setdefault(row["config"], {})[row["context_tokens"]] = row
    for name, rows in by_config.items():
        first = rows[result.settings["contexts"][0]]
        cells = " | ".join(pct_interval(rows[c]) for c in result.settings["contexts"])
        ratio = first["compression_ratio_vs_fp16"]
        lines.append(
            f"| {name} | `{first['config_label']}` | {ratio:.2f}x | {16 / ratio:.2f} | {cells} | "
            f"{'yes' if name in front else ''} |"
        )
    smallest = summary["smallest_within_budget"]
    lines += [
        "",
        f"{result.info.model} ({result.info.dtype}), {result.settings['documents']} texts x "
        f"{len(result.settings['seeds'])} rotation seeds (`polykv-agents bench frontier`). Smallest within "
        f"+{summary['budget_pct']:.0f}%: "
        + (f"**{smallest}** ({summary['smallest_within_budget_ratio']:.2f}x)" if smallest else "none")
        + f"; >= {summary['target_ratio']:.0f}x within it: {'yes' if summary['target_met'] else 'no'}.",
    ]
    return {"frontier": "\n".join(lines)}


SUITE = TableSuite(
    "frontier",
    "Pool bytes against perplexity delta: presets, smaller codec combinations, centered TurboQuant; Pareto front.",
    FrontierOptions,
    _measure,
    blocks=readme_blocks,
)
