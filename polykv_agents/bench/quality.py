"""``polykv-agents bench quality``: perplexity deltas by context length and config, and agreement of
pooled answers with full-precision answers.

- perplexity: the paper's protocol (:mod:`polykv_agents.eval.perplexity`) on ``documents`` disjoint
  texts; one prefill per (text, context), every config compressed from that same cache. One
  ``kind="ppl"`` row per (config, context) with the mean delta, its 95% t-interval and its range.
- agreement: per text, each question is answered greedily twice from one prefill: by a pooled agent
  (compressed pool, batched runtime) and by an agent over the uncompressed cache. One
  ``kind="agreement"`` row per config with exact match, token F1 and MiniLM cosine similarity.
"""

from __future__ import annotations

import functools
import shlex
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import Field, field_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polykv_agents.agent import PooledAgent
from polykv_agents.bench.configs import CONFIG_CHOICES, compressed_config_names, config_named
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Column, Progress, SuiteResult, column, markdown_table, write_suite
from polykv_agents.bench.suite import TableSuite, load_model_for
from polykv_agents.bench.sweep import SweepOptions, delta_fields, delta_samples, pct_interval, pct_range
from polykv_agents.config import CompressionConfig
from polykv_agents.eval.agreement import exact_match, token_f1
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool

Similarity = Callable[[Sequence[str], Sequence[str]], list[float]]

QUESTIONS = (
    "What is this part of the documentation about? Answer in one sentence.",
    "Name one keyword, statement or function the text describes.",
    "What does the text say happens when an error occurs?",
)


def ppl_rows(
    model, tokenizer, texts: Sequence[str], contexts: Sequence[int], configs: dict[str, CompressionConfig],
    continuation_tokens: int, progress: Progress,
) -> list[dict]:  # fmt: skip
    """One row per (config name, context) with the delta summarised over ``texts``."""
    deltas, ratios = delta_samples(
        model, tokenizer, texts, contexts, list(configs.items()), continuation_tokens, progress
    )
    return [
        {
            "kind": "ppl",
            "config": name,
            "config_label": configs[name].label(),
            "context_tokens": context,
            **delta_fields(samples),
            "delta_pct_per_document": [sample["delta_pct"] for sample in samples],
            "compression_ratio_vs_fp16": ratios[(name, context)],
        }
        for (name, context), samples in deltas.items()
    ]


def agreement_rows(
    model, tokenizer, texts: Sequence[str], context: int, configs: dict[str, CompressionConfig],
    max_new_tokens: int, similarity: Similarity | None, progress: Progress,
) -> list[dict]:  # fmt: skip
    """One row per config: pooled answers against answers over the uncompressed cache."""
    pairs: dict[str, list[tuple[str, str]]] = {name: [] for name in configs}
    for index, text in enumerate(texts):
        progress(f"agreement: document {index + 1}/{len(texts)}")
        ids = tokenizer(text, return_tensors="pt").input_ids[0][:context]
        cache, _ = prefill_cache(model, ids)
        full = SharedKVPool.from_cache(model, tokenizer, cache, ids, config=CompressionConfig.full_precision())
        reference = PooledAgent(full, model, tokenizer, runtime="private")
        expected = [reference.generate(q, max_new_tokens=max_new_tokens) for q in QUESTIONS]
        for name, config in configs.items():
            pool = SharedKVPool.from_cache(model, tokenizer, cache, ids, config=config)
            agent = PooledAgent(pool, model, tokenizer)
            answer = functools.partial(agent.generate, max_new_tokens=max_new_tokens)
            with ThreadPoolExecutor(max_workers=len(QUESTIONS)) as executor:  # batched by the runtime
                answers = list(executor.map(answer, QUESTIONS))
            pairs[name] += list(zip(answers, expected, strict=True))
    rows = []
    for name, answered in pairs.items():
        predictions, references = [p for p, _ in answered], [r for _, r in answered]
        row = {
            "kind": "agreement",
            "config": name,
            "config_label": configs[name].label(),
            "context_tokens": context,
            "answers": len(answered),
            "exact_match": statistics.fmean(exact_match(p, r) for p, r in answered),
            "token_f1": statistics.fmean(token_f1(p, r) for p, r in answered),
            "examples": [{"pooled": p, "full_precision": r} for p, r in answered[:3]],
        }
        if similarity is not None:
            row["minilm_cosine"] = statistics.fmean(similarity(predictions, references))
        rows.append(row)
    return rows


def run_quality_suite(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    contexts: Sequence[int] = (600, 2048, 4096, 7168),
    configs: dict[str, CompressionConfig] | None = None,
    continuation_tokens: int = 512,
    agreement_context: int = 2048,
    max_new_tokens: int = 48,
    similarity: Similarity | None = None,
    progress: Progress = lambda _: None,
    first_document: int = 0,
) -> SuiteResult:
    configs = configs or {name: CompressionConfig.preset(name) for name in ("default", "paper", "max")}
    rows = ppl_rows(model, tokenizer, texts, contexts, configs, continuation_tokens, progress)
    rows += agreement_rows(model, tokenizer, texts, agreement_context, configs, max_new_tokens, similarity, progress)
    return SuiteResult(
        suite="quality",
        info=RunInfo.collect(model),
        settings={
            "documents": len(texts),
            "first_document": first_document,
            "contexts": list(contexts),
            "continuation_tokens": continuation_tokens,
            "agreement_context": agreement_context,
            "questions_per_document": len(QUESTIONS),
            "max_new_tokens": max_new_tokens,
            "decoding": "greedy",
        },
        rows=rows,
    )


class QualityOptions(SweepOptions):
    contexts: list[int] = Field(default=[600, 2048, 4096, 7168], json_schema_extra={"flag": "--context"})
    """Context length (repeatable)."""
    configs: list[str] = Field(
        default=["default", "paper", "max"], validate_default=True, json_schema_extra={"flag": "--config"}
    )
    """Compression presets or the frontier's configs to compare with full precision (repeatable)."""
    agreement_context: int = Field(default=2048, ge=1)
    """Document tokens the agreement questions are asked over."""
    first_document: int = Field(default=0, ge=0)
    """Texts start at this index: the frontier chose `max` on texts 0-4, so 5 or more are held out."""

    @field_validator("configs")
    @classmethod
    def _known_configs(cls, configs: list[str]) -> list[str]:
        names = compressed_config_names(configs)
        if not names:
            raise ValueError(f"no compressed config to compare with full precision; {CONFIG_CHOICES}")
        return names


def _measure(options: QualityOptions, progress: Progress) -> SuiteResult:
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.eval.embeddings import minilm_similarity

    texts = pydoc_documents(options.first_document + options.documents)[options.first_document :]
    model, tokenizer = load_model_for(options.model)
    return run_quality_suite(
        model,
        tokenizer,
        texts,
        contexts=options.contexts,
        configs={name: config_named(name) for name in options.configs},
        agreement_context=options.agreement_context,
        similarity=minilm_similarity(),
        progress=progress,
        first_document=options.first_document,
    )


def readme_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's perplexity table: per context, each config's measured size and mean PPL delta [95% CI]."""
    ppl = {(row["config"], row["context_tokens"]): row for row in result.rows if row["kind"] == "ppl"}
    configs = list(dict.fromkeys(config for config, _ in ppl))
    contexts = result.settings["contexts"]
    labels = [f"{name} ({ppl[(name, contexts[0])]['config_label']})" for name in configs]
    lines = [
        "| context tokens | " + " | ".join(labels) + " |",
        "|---:|" + "---:|" * len(configs),
    ]
    for context in contexts:
        cells = [f"{ppl[(name, context)]['compression_ratio_vs_fp16']:.2f}x, {pct_interval(ppl[(name, context)])}"
                 for name in configs]  # fmt: skip
        lines.append(f"| {context:,} | " + " | ".join(cells) + " |")
    info, settings = result.info, result.settings
    lines += [
        "",
        f"Each cell: the pool's size against the model's cache in fp16 (measured bytes), then the perplexity "
        f"delta of the {settings['continuation_tokens']} tokens after the prefix, mean over "
        f"{settings['documents']} disjoint texts of pydoc_data.topics [95% CI]. {info.model}, {info.dtype}; "
        f"every config compressed from one prefill per text (`polykv-agents bench quality`).",
    ]
    return {"quality": "\n".join(lines)}


def ppl_delta_vs_context(rows: Sequence[dict], model: str):
    """Mean perplexity delta against context length, one line per config, range shaded."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    from polykv_agents.bench.plots import plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for index, config in enumerate(dict.fromkeys(r["config"] for r in rows)):
        points = sorted((r for r in rows if r["config"] == config), key=lambda r: r["context_tokens"])
        contexts = [r["context_tokens"] for r in points]
        label = f"{config} ({points[0]['config_label']}, {points[0]['compression_ratio_vs_fp16']:.2f}x)"
        axis.plot(contexts, [r["delta_pct_mean"] for r in points], "o-", color=f"C{index}", label=label)
        axis.fill_between(contexts, [r["delta_pct_min"] for r in points], [r["delta_pct_max"] for r in points],
                          color=f"C{index}", alpha=0.15)  # fmt: skip
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xticks(sorted({r["context_tokens"] for r in rows}))
    axis.xaxis.set_major_formatter(ScalarFormatter())
    axis.xaxis.set_minor_formatter(NullFormatter())  # only the measured lengths
    axis.set_xlabel("context tokens in the pool")
    axis.set_ylabel("perplexity delta vs full precision (%)")
    axis.set_title(f"Perplexity cost of compression: {model}\n(mean; shaded: min..max over documents)")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    return figure


def write_quality(result: SuiteResult, out_dir: Path) -> list[Path]:
    ppl = [r for r in result.rows if r["kind"] == "ppl"]
    agreement = [r for r in result.rows if r["kind"] == "agreement"]
    columns = [
        column("config", "config"),
        column("codecs", "config_label"),
        column("context", "context_tokens"),
        column("x vs fp16", "compression_ratio_vs_fp16", "{:.2f}"),
        Column("PPL delta, mean [95% CI]", pct_interval),
        Column("range", pct_range),
        column("documents", "documents"),
    ]
    agreement_columns = [
        column("config", "config"),
        column("answers", "answers"),
        column("exact match", "exact_match", "{:.2f}"),
        column("token F1", "token_f1", "{:.3f}"),
    ]
    if all("minilm_cosine" in r for r in agreement):
        agreement_columns.append(column("MiniLM cosine", "minilm_cosine", "{:.3f}"))
    notes = [
        "Agreement of pooled answers with answers over the uncompressed cache (greedy, same prompts, "
        f"{result.settings['agreement_context']}-token prefix). MiniLM cosine is the cosine similarity of "
        "all-MiniLM-L6-v2 sentence embeddings, not BERTScore (which needs a roberta-large download):\n\n"
        + markdown_table(agreement, agreement_columns)
    ]
    figures = {"ppl_vs_context": ppl_delta_vs_context(ppl, result.info.model)}
    first, count = result.settings.get("first_document", 0), result.settings["documents"]
    title = f"Quality, held-out texts {first}-{first + count - 1}" if first else "Quality"
    return write_suite(result, out_dir, title=title, columns=columns, figures=figures, notes=notes, table_rows=ppl)


PRESETS = ("--config", "default", "--config", "paper", "--config", "max")
REPRODUCE = (*PRESETS, "--config", "keys tq4, values tq3")
"""The presets and the ``max`` of 0.1, which the README's quality table compares."""
HELD_OUT = ("--first-document", "5", *PRESETS, "--out", "benchmarks/results/heldout")
"""The presets on texts 5-9, which the frontier that chose ``max`` (on texts 0-4) never saw."""

SUITE = TableSuite(
    "quality",
    "PPL delta by context and preset over several texts; pooled vs full-precision answer agreement.",
    QualityOptions,
    _measure,
    write_quality,
    command=f"polykv-agents bench quality {shlex.join(REPRODUCE)}",
    reproduce=(REPRODUCE, HELD_OUT),
    blocks=readme_blocks,
)
