"""The ``polykv-agents`` command line: ``demo``, ``eval ppl`` and ``bench`` (see :mod:`.bench_cli`).

User errors (bad documents, configs, missing models) print one ``error:`` line and exit 1; option
parsing errors are typer's (exit 2). Progress goes to stderr, results to stdout, so ``--json``
output can be piped.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer
from rich.panel import Panel
from rich.table import Table

from polykv_agents.cli.bench import bench_app
from polykv_agents.cli.support import (
    ModelOpt,
    clean_errors,
    err,
    load_model_with_spinner,
    mib,
    out,
    progress_bar,
    read_document,
)
from polykv_agents.config import CODEC_METHODS, PRESETS, SEED_MAX, CompressionConfig, describe_codecs

app = typer.Typer(help="Many LLM agents over one document, sharing one compressed KV cache.", no_args_is_help=True)
eval_app = typer.Typer(help="Quality evaluation.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")


DEMO_ROLES = [
    ("finance analyst", "You are the finance analyst. Answer with figures from the document.",
     "What was the operating surplus in 2025, and what will it be used for?"),
    ("network engineer", "You are the network engineer. Answer from the document's section on the network.",
     "How many main bursts were recorded in 2025, and which mains cause most of them?"),
    ("risk officer", "You are the risk officer. Be brief and list items.",
     "What are the three principal risks the Board identified?"),
]  # fmt: skip


# Options shared by commands that build a pool; the codec list is generated from the config classes.
KeyMethodOpt = Annotated[str, typer.Option("--key-method", help=f"Key codec. Codecs: {describe_codecs()}.")]
KeyBitsOpt = Annotated[int | None, typer.Option("--key-bits", help="Bits per key coordinate; default: the codec's.")]
KeyGranOpt = Annotated[
    str | None,
    typer.Option("--key-granularity", help="Key scale sharing, for codecs with a granularity (see --key-method)."),
]
ValueMethodOpt = Annotated[
    str, typer.Option("--value-method", help=f"Value codec, one of {', '.join(CODEC_METHODS)} (see --key-method).")
]
ValueBitsOpt = Annotated[
    int | None, typer.Option("--value-bits", help="Bits per value coordinate; default: the codec's.")
]


def _config(
    key_method: str,
    key_bits: int | None,
    key_granularity: str | None,
    value_method: str,
    value_bits: int | None,
    seed: int,
) -> CompressionConfig:
    return CompressionConfig.from_options(
        key_method=key_method,
        key_bits=key_bits,
        key_granularity=key_granularity,
        value_method=value_method,
        value_bits=value_bits,
        seed=seed,
    )


@app.command()
@clean_errors
def demo(
    document: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="Text file; default: the bundled sample.")
    ] = None,
    model: ModelOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per answer.")] = 64,
) -> None:
    """Build one compressed pool from a document and let three agent roles answer from it."""
    from polykv_agents.agent import PooledAgent
    from polykv_agents.pool.shared_pool import SharedKVPool

    if document is None:
        text = resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
        source = "bundled sample: Northwind Regional Water Authority, 2025 operations review"
    else:
        text, source = read_document(document), str(document)
    llm, tokenizer = load_model_with_spinner(model)
    messages = [
        {"role": "system", "content": "You are one of several analysts who share the document below. Answer from it."},
        {"role": "user", "content": text},
    ]
    with progress_bar() as progress:
        task = progress.add_task("Prefilling and compressing the document", total=None)
        started = time.perf_counter()
        pool = SharedKVPool.prefill(
            llm, tokenizer, messages, progress=lambda done, total: progress.update(task, completed=done, total=total)
        )
        build_s = time.perf_counter() - started
    out.print(f"[bold]Document:[/] {source} ({pool.num_tokens} tokens, built once in {build_s:.1f} s)")
    out.print(f"[bold]Pool:[/] {pool.config.label()}, {mib(pool.nbytes)}, digest {pool.digest[:12]}\n")

    for name, role_prompt, question in DEMO_ROLES:
        agent = PooledAgent(pool, llm, tokenizer, system_prompt=role_prompt, name=name)
        started = time.perf_counter()
        with err.status(f"{name} is answering ..."):
            answer = agent.generate(question, max_new_tokens=max_new_tokens)
        elapsed = time.perf_counter() - started
        title = f"[bold]{name}[/] — {question}"
        out.print(Panel(answer.strip() or "(empty answer)", title=title, subtitle=f"{elapsed:.1f} s", expand=True))

    report = pool.memory_report(len(DEMO_ROLES))
    table = Table(title=f"KV memory: {report.n_agents} agents over one {report.num_tokens}-token document")
    table.add_column("what")
    table.add_column("bytes", justify="right")
    table.add_column("size", justify="right")
    for label, nbytes in report.rows():
        table.add_row(label, f"{nbytes:,}", mib(nbytes))
    out.print(table)
    out.print(
        f"Compression against one fp16 cache: [bold]{pool.compression_ratio:.2f}x[/] (measured); against "
        f"{report.n_agents} separate fp16 caches the pool saves {100 * report.saving_vs_fp16:.1f}%."
    )


@eval_app.command("ppl")
@clean_errors
def eval_ppl(
    document: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="UTF-8 text file to evaluate on.")],
    context_tokens: Annotated[int, typer.Option(help="Prefix tokens held in the pool.")] = 2048,
    continuation_tokens: Annotated[int, typer.Option(help="Following tokens whose perplexity is measured.")] = 512,
    key_method: KeyMethodOpt = "int",
    key_bits: KeyBitsOpt = None,
    key_granularity: KeyGranOpt = None,
    value_method: ValueMethodOpt = "turboquant",
    value_bits: ValueBitsOpt = None,
    seed: Annotated[int, typer.Option(help=f"Rotation seed, 0..{SEED_MAX}.")] = 0,
    preset: Annotated[
        str | None, typer.Option(help=f"{', '.join(PRESETS)}: a named config instead of the codec options.")
    ] = None,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Perplexity of a continuation with the pool's cache vs the full-precision cache."""
    from polykv_agents.eval.perplexity import perplexity_deltas

    if preset is not None:
        config = CompressionConfig.preset(preset).with_seed(seed)
    else:
        config = _config(key_method, key_bits, key_granularity, value_method, value_bits, seed)
    text = read_document(document)
    llm, tokenizer = load_model_with_spinner(model)
    with err.status("Prefilling, compressing and scoring ..."):
        (result,) = perplexity_deltas(
            llm,
            tokenizer,
            text,
            context_tokens=context_tokens,
            continuation_tokens=continuation_tokens,
            configs=[config],
        )
    if as_json:
        typer.echo(json.dumps(result.model_dump()))
        return
    table = Table(title=f"Perplexity, {result.model_name} ({result.dtype}), {result.num_tokens}-token prefix")
    for column in ("config", "ppl full", "ppl pool", "delta", "pool", "x vs fp16"):
        table.add_column(column, justify="right")
    table.add_row(
        result.config,
        f"{result.ppl_full:.4f}",
        f"{result.ppl_pool:.4f}",
        f"{result.delta_pct:+.3f}%",
        mib(result.pool_nbytes),
        f"{result.compression_ratio:.2f}",
    )
    out.print(table)


def main() -> None:
    """Console-script entry point."""
    app()
