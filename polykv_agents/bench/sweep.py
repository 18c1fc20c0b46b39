"""Perplexity deltas of many configs over texts x context lengths, for the quality and ablation
suites: one prefill per (text, context) serves every config (:func:`perplexity_deltas`).

Every (document, seed) sample is kept, so the intervals can be derived again from the JSON. The
independent unit is the document: seeds of one config on one document share its text and its
full-precision reference, so they are averaged within the document before the interval is taken
over documents (:func:`delta_fields`)."""

from __future__ import annotations

import statistics
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
) -> tuple[dict[tuple[str, int], list[dict]], dict[tuple[str, int], float]]:  # fmt: skip
    """``(samples, ratios)`` keyed by (run name, context): one ``{"document", "seed", "delta_pct"}`` per text
    and per run of that name (several runs may share a name: its seeds), and the measured ratio vs fp16."""
    samples: dict[tuple[str, int], list[dict]] = {}
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
            for (name, config), result in zip(runs, results, strict=True):
                sample = {"document": index, "seed": config.seed, "delta_pct": result.delta_pct}
                samples.setdefault((name, context), []).append(sample)
                ratios[(name, context)] = result.compression_ratio
    return samples, ratios


def per_document_means(samples: Sequence[dict]) -> list[float]:
    """The mean delta of each document over its seeds, in document order."""
    by_document: dict[int, list[float]] = {}
    for sample in samples:
        by_document.setdefault(sample["document"], []).append(sample["delta_pct"])
    return [statistics.fmean(by_document[document]) for document in sorted(by_document)]


def delta_fields(samples: Sequence[dict]) -> dict[str, float | int]:
    """The ``delta_pct_*`` columns of a row: mean, 95% t-interval over documents (seeds averaged within a
    document), and the range of the per-document means."""
    interval = mean_interval(per_document_means(samples))
    return {
        "delta_pct_mean": interval.mean,
        "delta_pct_ci_low": interval.low,
        "delta_pct_ci_high": interval.high,
        "delta_pct_min": interval.min,
        "delta_pct_max": interval.max,
        "documents": interval.n,
    }


def pct_interval(row: dict) -> str:
    """A row's :func:`delta_fields` as ``+0.12% [-0.30, +0.54]``: the mean delta and its 95% interval."""
    return f"{row['delta_pct_mean']:+.2f}% [{row['delta_pct_ci_low']:+.2f}, {row['delta_pct_ci_high']:+.2f}]"


def pct_range(row: dict) -> str:
    """A row's range of per-document mean deltas, ``-0.10 .. +0.41``."""
    return f"{row['delta_pct_min']:+.2f} .. {row['delta_pct_max']:+.2f}"
