"""``polykv-agents bench <suite>``: each suite writes ``<out>/<suite>.json``, ``<suite>.md`` and its
PNG plots; ``python benchmarks/render_results.py`` then regenerates docs/RESULTS.md from them.

Texts: disjoint slices of CPython's ``pydoc_data.topics`` (present offline), or ``--document``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from polykv_agents.cli.support import (
    ModelOpt,
    clean_errors,
    err,
    load_model_with_spinner,
    out,
    progress_bar,
    read_document,
)

bench_app = typer.Typer(help="Benchmarks (measured, with warm-up and medians).", no_args_is_help=True)

OutOpt = Annotated[Path, typer.Option("--out", file_okay=False, help="Folder for the JSON, Markdown and PNG files.")]
DocumentOpt = Annotated[
    Path | None, typer.Option(exists=True, dir_okay=False, help="UTF-8 text; default: pydoc_data.topics.")
]
DocumentsOpt = Annotated[int, typer.Option(min=1, help="Disjoint pydoc_data.topics texts to average over.")]
ContextsOpt = Annotated[list[int] | None, typer.Option("--context", min=16, help="Context length (repeatable).")]
AgentsOpt = Annotated[list[int] | None, typer.Option("--agents", min=1, max=64, help="Agent count (repeatable).")]
RepetitionsOpt = Annotated[int, typer.Option(min=1, help="Timed repetitions after one warm-up.")]
DEFAULT_OUT = Path("benchmarks/results")


@contextmanager
def _steps(total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar that advances once per suite step and shows the step's description."""
    with progress_bar() as progress:
        task = progress.add_task("starting", total=total)

        def step(description: str) -> None:
            progress.update(task, description=description, advance=1)

        yield step


def _single_text(document: Path | None) -> str:
    from polykv_agents.eval.corpus import pydoc_documents

    return read_document(document) if document else pydoc_documents(1, chars_per_document=60_000)[0]


def _report(written: list[Path]) -> None:
    for path in written:
        out.print(f"wrote {path}")


@bench_app.command("memory")
@clean_errors
def bench_memory(
    contexts: ContextsOpt = None,
    agents: AgentsOpt = None,
    document: DocumentOpt = None,
    out_dir: OutOpt = DEFAULT_OUT,
    model: ModelOpt = None,
) -> None:
    """KV bytes and peak RSS for 1..15 agents at 600..7K tokens, ours vs a cache per agent."""
    from polykv_agents.bench.memory import run_memory_suite
    from polykv_agents.bench.writers import write_memory

    contexts, agents = contexts or [600, 2048, 4096, 7168], agents or [1, 3, 5, 10, 15]
    text = _single_text(document)
    llm, tokenizer = load_model_with_spinner(model)
    with _steps(len(contexts) * (1 + len(agents))) as step:
        result = run_memory_suite(llm, tokenizer, text, contexts=contexts, agent_counts=agents, progress=step)
    _report(write_memory(result, out_dir))


@bench_app.command("speed")
@clean_errors
def bench_speed(
    contexts: ContextsOpt = None,
    agents: AgentsOpt = None,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens each agent decodes.")] = 32,
    repetitions: RepetitionsOpt = 3,
    document: DocumentOpt = None,
    out_dir: OutOpt = DEFAULT_OUT,
    model: ModelOpt = None,
) -> None:
    """TTFT pool vs re-prefill, decode tokens/s vs agents, compress and decompress time."""
    from polykv_agents.bench.speed import run_speed_suite
    from polykv_agents.bench.writers import write_speed

    contexts, agents = contexts or [2048, 4096], agents or [1, 3, 5, 10, 15]
    text = _single_text(document)
    llm, tokenizer = load_model_with_spinner(model)
    with _steps(2 * len(contexts) + len(agents)) as step:
        result = run_speed_suite(
            llm, tokenizer, text, contexts=contexts, agent_counts=agents, new_tokens=new_tokens,
            repetitions=repetitions, progress=step,
        )  # fmt: skip
    _report(write_speed(result, out_dir))


@bench_app.command("quality")
@clean_errors
def bench_quality(
    contexts: ContextsOpt = None,
    documents: DocumentsOpt = 5,
    out_dir: OutOpt = DEFAULT_OUT,
    model: ModelOpt = None,
) -> None:
    """PPL delta by context and preset over several texts; pooled vs full-precision answer agreement."""
    from polykv_agents.bench.quality import run_quality_suite
    from polykv_agents.bench.writers import write_quality
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.eval.embeddings import minilm_similarity

    contexts = contexts or [600, 2048, 4096, 7168]
    texts = pydoc_documents(documents)
    llm, tokenizer = load_model_with_spinner(model)
    similarity = minilm_similarity()
    with _steps(len(contexts) * documents + documents) as step:
        result = run_quality_suite(llm, tokenizer, texts, contexts=contexts, similarity=similarity, progress=step)
    _report(write_quality(result, out_dir))


@bench_app.command("ablation")
@clean_errors
def bench_ablation(
    contexts: ContextsOpt = None,
    documents: DocumentsOpt = 5,
    seeds: Annotated[int, typer.Option(min=1, help="Rotation seeds per seed-dependent config.")] = 3,
    out_dir: OutOpt = DEFAULT_OUT,
    model: ModelOpt = None,
) -> None:
    """One factor at a time (rotation, signs, key granularity and bits, value bits), seeds and CIs."""
    from polykv_agents.bench.ablation import run_ablation_suite
    from polykv_agents.bench.writers import write_ablation
    from polykv_agents.eval.corpus import pydoc_documents

    contexts = contexts or [2048, 4096]
    texts = pydoc_documents(documents)
    llm, tokenizer = load_model_with_spinner(model)
    with _steps(len(contexts) * documents) as step:
        result = run_ablation_suite(llm, tokenizer, texts, contexts=contexts, seeds=list(range(seeds)), progress=step)
    _report(write_ablation(result, out_dir))


@bench_app.command("agents")
@clean_errors
def bench_agents(
    document: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="UTF-8 text file (the shared prefix).")],
    agents: Annotated[int, typer.Option(min=1, max=64, help="Concurrent agents.")] = 15,
    context_tokens: Annotated[int, typer.Option(min=16, help="Document tokens in the pool.")] = 2048,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens each agent decodes.")] = 32,
    repetitions: Annotated[int, typer.Option(min=1, help="Timed repetitions after one warm-up.")] = 3,
    runtime: Annotated[str, typer.Option(help="Prefix residency: decompressed or compressed.")] = "decompressed",
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """N concurrent agents over one pool vs sequential agents vs naive batching over a copied prefix."""
    from polykv_agents.bench.agents import run_agents_bench

    if runtime not in ("decompressed", "compressed"):
        msg = f"--runtime must be decompressed or compressed, got {runtime!r}"
        raise ValueError(msg)
    text = read_document(document)
    llm, tokenizer = load_model_with_spinner(model)
    with err.status(f"Running {agents} agents x {repetitions + 1} repetitions ..."):
        result = run_agents_bench(
            llm,
            tokenizer,
            text,
            agents=agents,
            context_tokens=context_tokens,
            max_new_tokens=max_new_tokens,
            repetitions=repetitions,
            runtime=runtime,  # type: ignore[arg-type]
        )
    if as_json:
        typer.echo(json.dumps(result.model_dump()))
        return
    table = Table(title=f"{agents} agents, {result.context_tokens}-token pool, {result.model_name} ({result.dtype})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.model_dump().items():
        table.add_row(
            key, f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value)
        )
    out.print(table)


@bench_app.command("peer")
@clean_errors
def bench_peer(
    peer_python: Annotated[
        Path, typer.Option(exists=True, dir_okay=False, help="Python of an environment with polykv-llm==0.1.0.")
    ],
    documents: DocumentsOpt = 3,
    context_tokens: Annotated[int, typer.Option(min=16, help="Document tokens in the pool.")] = 2048,
    continuation_tokens: Annotated[int, typer.Option(min=2, help="Tokens whose perplexity is measured.")] = 512,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per answer.")] = 32,
    agents: Annotated[int, typer.Option(min=1, max=64, help="Agents at once for the memory rows.")] = 15,
    out_dir: OutOpt = DEFAULT_OUT,
) -> None:
    """Side by side with the reference implementation polykv-llm 0.1.0, run in its own environment."""
    from polykv_agents.bench.peer import run_peer_suite
    from polykv_agents.bench.writers import write_peer
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.eval.embeddings import minilm_similarity

    texts = pydoc_documents(documents)
    llm, tokenizer = load_model_with_spinner(None)  # the peer loads the same embedded GGUF file
    similarity = minilm_similarity()
    with _steps(2 + documents) as step:
        result = run_peer_suite(
            llm, tokenizer, texts, peer_python=str(peer_python), context_tokens=context_tokens,
            continuation_tokens=continuation_tokens, max_new_tokens=max_new_tokens, agents=agents,
            similarity=similarity, progress=step,
        )  # fmt: skip
    _report(write_peer(result, out_dir))
