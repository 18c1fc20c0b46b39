"""``python -m benchmarks weights``: native weights against weight-only int8 and int4, side by side in one run.

All three copies of the model are loaded in the dtype ``auto`` picks (bf16 on this project's machine):

- speed (``kind="speed"``, one row per weights): the document's prefill, and ms per decode step through the
  runtime with 1 and with N agents, medians after a warm-up (:func:`benchmarks.studies.dtypes.speed_row`),
  and the bytes of the model's tensors (``nbytes`` of its parameters and buffers);
- kernels (``kind="kernel"``): one projection, the model's own ``mlp.up_proj`` of every layer in turn (so the
  weights are read from memory, as in a step, not from a cache), and the output layer, at 1, N and 512 rows;
- perplexity (``kind="ppl"``, one row per document and weights): the paper's protocol (the text after a
  ``context``-token prefix) with the model's own full cache, with the default pool built by the native model,
  and with the default pool built by the model itself (one pool digest for all three). Every delta is
  against the native model with its own full cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from benchmarks.studies.dtypes import DtypeOptions, perplexity, ppl_phrase, speed_row
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Column, Progress, SuiteResult, column, markdown_table, write_suite
from polykv_agents.bench.stats import mean_interval
from polykv_agents.bench.step_costs import median_ms_on_compute_thread
from polykv_agents.bench.suite import TableSuite
from polykv_agents.bench.sweep import pct_interval
from polykv_agents.codecs.encoded import dtype_name
from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.eval.perplexity import prefix_and_continuation
from polykv_agents.model.weights import WEIGHTS
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool

COMMAND = "python -m benchmarks weights"

KERNEL_ROWS = (1, 512)
"""Row counts of the kernel rows besides the agent count: one agent's decode step, one prefill chunk."""


def model_nbytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (a tied tensor counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for t in tensors.values())


def _kernel_rows(weights: str, model, rows: Sequence[int], repetitions: int) -> list[dict]:
    projections = [m for name, m in model.named_modules() if name.endswith("mlp.up_proj")]
    layers = {"mlp.up_proj, every layer in turn": projections, "output layer": [model.get_output_embeddings()]}
    out = []
    for layer, modules in layers.items():
        if not modules:
            continue
        for count in rows:
            x = torch.randn(count, modules[0].in_features, dtype=model.dtype)

            def work(x=x, modules=modules) -> None:
                with torch.inference_mode():
                    for module in modules:
                        module(x)

            ms = median_ms_on_compute_thread(repetitions, work)
            out.append(
                {
                    "kind": "kernel",
                    "weights": weights,
                    "layer": layer,
                    "shape": f"[{modules[0].out_features}, {modules[0].in_features}]",
                    "rows": count,
                    "us_per_call": 1000 * ms / len(modules),
                }
            )
    return out


def _ppl_rows(models: dict, tokenizer, texts: Sequence[str], context: int, continuation_tokens: int) -> list[dict]:
    rows = []
    native = models["native"]
    for document, text in enumerate(texts):
        prefix, continuation = prefix_and_continuation(native, tokenizer, text, context, continuation_tokens)
        caches = {name: prefill_cache(model, prefix)[0] for name, model in models.items()}
        pools = {name: SharedKVPool.from_cache(models[name], tokenizer, caches[name], prefix) for name in models}
        assert len({pool.digest for pool in pools.values()}) == 1, "one pool digest for every weights setting"
        reference = perplexity(native, caches["native"], continuation, context)  # consumes that cache
        start = context
        for name, model in models.items():
            rows.append(
                {
                    "kind": "ppl",
                    "document": document,
                    "weights": name,
                    "context_tokens": context,
                    "continuation_tokens": continuation_tokens,
                    "ppl_native_full": reference,
                    "ppl_full": reference
                    if name == "native"
                    else perplexity(model, caches[name], continuation, context),
                    "ppl_pool_built_native": perplexity(model, pools["native"].to_cache(model), continuation, start),
                    "ppl_pool_built_self": perplexity(model, pools[name].to_cache(model), continuation, start),
                }
            )
    return rows


_CACHES = (
    ("ppl_full", "its own full cache"),
    ("ppl_pool_built_native", "default pool built by the native model"),
    ("ppl_pool_built_self", "default pool built by this model"),
)


def ppl_summary(rows: Sequence[dict]) -> list[dict]:
    """Per weights and cache: mean PPL delta vs the native model's full cache, with an interval over documents."""
    summary = []
    for weights in WEIGHTS:
        mine = [r for r in rows if r["kind"] == "ppl" and r["weights"] == weights]
        for field, cache in _CACHES:
            deltas = [100 * (r[field] - r["ppl_native_full"]) / r["ppl_native_full"] for r in mine]
            interval = mean_interval(deltas)
            summary.append(
                {
                    "weights": weights,
                    "cache": cache,
                    "delta_pct_mean": interval.mean,
                    "delta_pct_ci_low": interval.low,
                    "delta_pct_ci_high": interval.high,
                    "documents": interval.n,
                }
            )
    return summary


class WeightsOptions(DtypeOptions):
    """The dtype suite's settings: the same document, agents, steps and perplexity protocol."""


def _measure(options: WeightsOptions, progress: Progress) -> SuiteResult:
    from polykv_agents.engine import load_model

    loaded = {name: load_model(options.model, weights=name) for name in WEIGHTS}
    models, tokenizer = {name: model for name, (model, _) in loaded.items()}, loaded["native"][1]
    texts = pydoc_documents(options.documents, chars_per_document=8 * (options.context + options.continuation_tokens))
    ids = tokenizer(texts[0], return_tensors="pt").input_ids[0][: options.context]
    rows = []
    for name, model in models.items():
        progress(f"{name}: prefill, decode steps and kernels")
        row = speed_row(model, tokenizer, ids, options.agents, options.new_tokens, options.repetitions)
        rows.append({**row, "weights": name, "model_mib": model_nbytes(model) / 2**20})
        rows += _kernel_rows(name, model, (KERNEL_ROWS[0], options.agents, KERNEL_ROWS[1]), 10 * options.repetitions)
    progress(f"perplexity over {options.documents} documents, every weights setting")
    rows += _ppl_rows(models, tokenizer, texts, options.context, options.continuation_tokens)
    speed = {r["weights"]: r for r in rows if r["kind"] == "speed"}
    native = speed["native"]
    return SuiteResult(
        suite="weights",
        info=RunInfo.collect(models["native"]),
        settings=options.model_dump(mode="json"),
        rows=rows,
        summary={
            "ppl": ppl_summary(rows),
            "dtype": dtype_name(models["native"].dtype),
            "speedup": {
                name: {
                    "prefill": native["prefill_s"] / r["prefill_s"],
                    "step_1": native["ms_per_step_1"] / r["ms_per_step_1"],
                    "step_n": native["ms_per_step_n"] / r["ms_per_step_n"],
                }
                for name, r in speed.items()
            },
        },
    )


def doc_blocks(result: SuiteResult) -> dict[str, str]:
    """The README's sentence on ``weights=``."""
    speed = {r["weights"]: r for r in result.rows if r["kind"] == "speed"}
    summary, native = result.summary["ppl"], speed["native"]
    n = native["agents"]
    parts = [
        f"{name} {r['ms_per_step_1']:.0f} ms per step for one agent and {r['ms_per_step_n']:.0f} ms for {n}, a "
        f"{r['context_tokens']:,}-token prefill in {r['prefill_s']:.1f} s, {r['model_mib']:.0f} MiB of weights, "
        f"perplexity {ppl_phrase(summary, 'default pool built by this model', weights=name)} with a pool it built and "
        f"{ppl_phrase(summary, 'default pool built by the native model', weights=name)} with the native model's pool"
        for name, r in speed.items()
        if name != "native"
    ]
    weights = (
        f"On this machine, in {result.summary['dtype']}: native weights {native['ms_per_step_1']:.0f} ms per step for "
        f"one agent and {native['ms_per_step_n']:.0f} ms for {n}, prefill in {native['prefill_s']:.1f} s, "
        f"{native['model_mib']:.0f} MiB of weights; " + "; ".join(parts) + " (perplexity against the native model "
        f"with its full cache; `{COMMAND}`, {result.info.date}, {result.settings['documents']} "
        "documents; docs/RESULTS.md, weights)."
    )
    return {"weights": weights}


def write_weights(result: SuiteResult, out_dir: Path) -> list[Path]:
    """Speed and size per weights setting make the main table; kernels and perplexity get tables in the notes."""
    speed = [r for r in result.rows if r["kind"] == "speed"]
    n = speed[0]["agents"]
    columns = [
        column("weights", "weights"),
        column("dtype", "dtype"),
        column("MiB of weights", "model_mib", "{:.0f}"),
        column("prefill s", "prefill_s", "{:.2f}"),
        column("ms per step, 1 agent", "ms_per_step_1", "{:.1f}"),
        column(f"ms per step, {n} agents", "ms_per_step_n", "{:.1f}"),
        column(f"tokens/s, {n} agents", "tok_s_n", "{:.1f}"),
    ]
    kernels = markdown_table(
        [r for r in result.rows if r["kind"] == "kernel"],
        [
            column("weights", "weights"),
            column("layer", "layer"),
            column("weight shape", "shape"),
            column("rows", "rows"),
            column("µs per call", "us_per_call", "{:.0f}"),
        ],
    )
    ppl = markdown_table(
        result.summary["ppl"],
        [
            column("weights", "weights"),
            column("cache", "cache"),
            Column("PPL delta vs native full cache, mean [95% CI]", pct_interval),
            column("documents", "documents"),
        ],
    )
    settings = result.settings
    notes = [
        f"All three in one run, {settings['repetitions']} repetitions after a warm-up (medians). ms per step: the "
        "median time between an agent's consecutive tokens while all decode through the runtime, over a pool built "
        "by that model. MiB of weights: `nbytes` of the model's parameters and buffers (a tied tensor once).",
        "One projection per call, the weights read from memory (every layer's `mlp.up_proj` in turn), and the "
        "output layer, each layer as `weights=` runs it (`polykv_agents/model/quantized_linear.py`: int8 on the native "
        "tile kernel where the CPU has AMX and the model is bf16, else on PyTorch's; int4 on PyTorch's):\n\n" + kernels,
        f"Perplexity of the {settings['continuation_tokens']} tokens after a {settings['context']}-token prefix, "
        f"{settings['documents']} pydoc texts, intervals over documents. One pool digest serves every setting:\n\n"
        + ppl,
    ]
    return write_suite(result, out_dir, title="Weight-only int8 and int4", columns=columns, notes=notes,
                       table_rows=speed)  # fmt: skip


SUITE = TableSuite(
    "weights",
    "native weights against weight-only int8 and int4 in one run: prefill, decode steps, kernels, perplexity.",
    WeightsOptions,
    _measure,
    write_weights,
    command=COMMAND,
    blocks=doc_blocks,
)
