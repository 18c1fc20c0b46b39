"""Perplexity deltas of many configs over texts x context lengths, for the quality and ablation
suites: one prefill per (text, context) serves every config (:func:`perplexity_deltas`)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from polykv_agents.bench.output import Progress
from polykv_agents.bench.stats import mean_interval
from polykv_agents.bench.suite import SuiteOptions
from polykv_agents.config import CompressionConfig
from polykv_agents.eval.perplexity import perplexity_deltas


class SweepOptions(SuiteOptions):
    """Options of a sweep over context lengths and disjoint texts (the quality and ablation suites)."""

    contexts: list[int] = Field(default=[2048, 4096], json_schema_extra={"flag": "--context"})
    """Context length (repeatable)."""
    documents: int = Field(default=5, ge=1)
    """Disjoint pydoc_data.topics texts to average over."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


def delta_samples(
    model, tokenizer, texts: Sequence[str], contexts: Sequence[int], runs: Sequence[tuple[str, CompressionConfig]],
    continuation_tokens: int, progress: Progress,
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], float]]:  # fmt: skip
    """``(deltas, ratios)`` keyed by (run name, context): the PPL deltas over every text and every run
    of that name (several runs may share a name, e.g. seeds), and the measured ratio vs fp16."""
    deltas: dict[tuple[str, int], list[float]] = {}
    ratios: dict[tuple[str, int], float] = {}
    for context in contexts:
        for index, text in enumerate(texts):
            progress(f"perplexity: context {context}, document {index + 1}/{len(texts)}, {len(runs)} pools")
            results = perplexity_deltas(
                model,
                tokenizer,
                text,
                context_tokens=context,
                continuation_tokens=continuation_tokens,
                configs=[config for _, config in runs],
            )
            for (name, _), result in zip(runs, results, strict=True):
                deltas.setdefault((name, context), []).append(result.delta_pct)
                ratios[(name, context)] = result.compression_ratio
    return deltas, ratios


def delta_fields(values: Sequence[float]) -> dict[str, float]:
    """The ``delta_pct_*`` columns of a row: mean, 95% t-interval and range of ``values``."""
    interval = mean_interval(values)
    return {
        "delta_pct_mean": interval.mean,
        "delta_pct_ci_low": interval.low,
        "delta_pct_ci_high": interval.high,
        "delta_pct_min": interval.min,
        "delta_pct_max": interval.max,
    }
