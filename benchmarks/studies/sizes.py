"""``python -m benchmarks sizes``: the 15-role review on a model of a size users run (1B+ parameters, published
shapes, random weights), against llama.cpp, each method in a process of its own.

The peers' protocol (:mod:`benchmarks.studies.peers`) on a model of :mod:`benchmarks.real_shapes`: the same
documents (pydoc texts), the same prompts and the same number of tokens per call (EOS ignored), llama.cpp replaying
our recorded calls token for token over one context, so its prefix reuse keeps the document. Per method and
context: the review's wall and stage times, TTFT from scratch / cold / warm, decode speed for 1 and 15 agents,
prefill speed, the KV bytes held for the document and the peak RSS (``VmHWM``, the model's load included).

- **ours** (:mod:`benchmarks.studies.ours_side`, the model's folder in its request): the review graph with one
  pool, per ``--weights`` setting;
- **llama.cpp** (llama-cpp-python, :mod:`benchmarks.studies.llamacpp_side`), flash attention on, prefix reuse,
  one row per GGUF file (``--gguf``: made by llama.cpp's own converter and quantizer from the same random
  weights), and with ``--quantized-cache`` one more row on the first file with its KV cache in q8_0 (keys and
  values), the peer for the pool's bytes;
- **llama-server** (``--llama-server``), one slot, prompt cache, on the first file.

``--peers-from`` sets ours beside the llama-cpp-python rows of an earlier run (same model, contexts, documents,
roles and tokens) instead of running them again, for a commit that changed our side only: a 1B run of llama.cpp's
five processes takes hours on 2 cores. ``--llama-server`` with it measures the server's row now, replaying this
run's calls. Those rows replay the earlier commit's recorded calls: the same calls and
tokens per call, whose answer tokens (noise, from random weights) may differ. The result names both commits, and
the docs mark it stale where either side's code changed (``sizes`` and ``sizes.peers`` in
:mod:`benchmarks.staleness`).

**Random weights are meaningless for quality**: these figures are time and memory only. Each run writes
``sizes/<model>_<contexts>.json`` and its Markdown under ``--out``; the docs show every run there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, FilePath, field_validator, model_validator

from benchmarks.real_shapes import GGUF_TYPES, PUBLISHED, model_dir
from benchmarks.studies.peers import (
    AGENTS,
    LLAMACPP_SIDE,
    SIDE_TIMEOUT_S,
    installed_version,
    llama_cpp_method,
    llama_cpp_row,
    llama_server_row,
    our_method,
    our_row,
    replay_context,
    replay_probes,
    threads,
)
from benchmarks.studies.side_process import run_side_kept
from benchmarks.studies.workflows import LANGGRAPH_JSON
from polykv_agents.bench.output import MIB, Progress
from polykv_agents.bench.provenance import Provenance
from polykv_agents.bench.suite import Rendered, SuiteOptions
from polykv_agents.model.weights import check_weights_choice

Q8_CACHE = ["q8_0", "q8_0"]
"""llama.cpp's KV cache in q8_0, keys and values (``--cache-type-k q8_0 --cache-type-v q8_0``): the issue's peer
for the pool's bytes at these sizes."""
CHARS_PER_DOCUMENT = 120_000
"""Longer texts than the peers' 60,000 characters: 16K tokens of the tokenizer need about 70,000."""
FOLDER = "sizes"
"""The results folder's subfolder, a JSON file and its Markdown per run."""
SAME_RUN = ("model", "contexts", "documents", "roles", "max_tokens")
"""Settings a run and the run whose llama.cpp rows it borrows (``--peers-from``) must share."""


class SizesOptions(SuiteOptions):
    model: str = "Llama-3.2-1B"
    """A model of benchmarks/real_shapes.py (its folder made first: ``python -m benchmarks.real_shapes``)."""
    contexts: list[int] = Field(default=[8192], json_schema_extra={"flag": "--context"})
    """Document tokens (repeatable)."""
    documents: int = Field(default=3, ge=1)
    """Independent documents (pydoc texts): every method runs the review and the probe once on each."""
    max_tokens: int = Field(default=32, ge=1)
    """Tokens every free-text answer decodes (EOS ignored), for every method."""
    weights: list[str] = Field(default=["auto"], min_length=1)
    """How our model stores its weights (auto: the default, native, int8, int4), a row each (repeatable);
    llama.cpp replays the calls of the first."""
    gguf: list[str] = Field(default=["Q8_0", "Q4_0"], min_length=1)
    """llama.cpp's files, a row each (repeatable): made by ``python -m benchmarks.real_shapes --gguf``."""
    quantized_cache: bool = False
    """One more llama.cpp row: the first file with a q8_0 KV cache."""
    llama_server: FilePath | None = None
    """The llama-server binary (built from the llama-cpp-python sdist's llama.cpp); without it, no server row."""
    peers_from: FilePath | None = None
    """An earlier run's JSON whose llama.cpp rows to set beside ours, instead of running llama.cpp."""
    keep_in: Path | None = None
    """A folder where each side process's result is kept as it finishes, so that a run stopped part way starts
    again where it stopped (at the same commit, with no uncommitted changes)."""

    @field_validator("model")
    @classmethod
    def _published(cls, value: str) -> str:
        if value not in PUBLISHED:
            msg = f"--model {value!r} is none of benchmarks/real_shapes.py's models: {', '.join(PUBLISHED)}"
            raise ValueError(msg)
        return value

    @field_validator("weights")
    @classmethod
    def _known_weights(cls, value: list[str]) -> list[str]:
        return [check_weights_choice(weights) for weights in value]

    @field_validator("gguf")
    @classmethod
    def _known_files(cls, value: list[str]) -> list[str]:
        unknown = [fmt for fmt in value if fmt not in GGUF_TYPES]
        if unknown:
            msg = f"--gguf {unknown[0]} is not one of {', '.join(GGUF_TYPES)}"
            raise ValueError(msg)
        return value

    @model_validator(mode="after")
    def _borrowed_or_run(self) -> SizesOptions:
        if self.peers_from is not None and self.quantized_cache:
            msg = (
                "--peers-from takes llama-cpp-python's rows from that run, the q8_0 cache's too: drop --quantized-cache"
            )
            raise ValueError(msg)
        return self


class SizesResult(BaseModel):
    provenance: Provenance
    """The run: our rows (and llama.cpp's, unless borrowed)."""
    peers_provenance: Provenance | None = None
    """Where the llama.cpp rows come from an earlier run (``--peers-from``): its commit."""
    settings: dict[str, Any]
    rows: list[dict[str, Any]]


def gguf_path(model: str, kind: str) -> Path:
    """``model``'s GGUF file of type ``kind``; a clear error if it was not made yet."""
    path = model_dir(model) / f"{model}-{kind}.gguf"
    if not path.is_file():
        msg = (
            f"no {kind} GGUF of {model} at {path}: make it first with `python -m benchmarks.real_shapes --model "
            f"{model} --llama-cpp LLAMA_CPP_SOURCE --gguf {kind}`"
        )
        raise FileNotFoundError(msg)
    return path


def is_ours(row: dict[str, Any]) -> bool:
    return "gguf_format" not in row


def _ours(options: SizesOptions, context: int, texts: list[str], roles: list[str], progress: Progress):
    """Our rows at ``context``, a process per weights setting; the first setting's side result (its calls)."""
    rows, first = [], None
    for weights in options.weights:
        method = our_method(weights)
        progress(f"context {context}: {method}")
        request = {
            "model": str(model_dir(options.model)), "weights": weights, "compiled": False,
            "graphs": str(LANGGRAPH_JSON), "max_tokens": options.max_tokens, "roles": roles, "context": context,
            "texts": texts,
        }  # fmt: skip
        row, side = our_row(request, method, options.keep_in)
        rows.append(row)
        first = first or side
    return rows, first


def _llama_cpp(options: SizesOptions, context: int, side: dict, progress: Progress) -> list[dict]:
    """llama.cpp's rows at ``context``: each GGUF file, flash attention on; the q8_0 cache on the first file."""
    runs: list[tuple[str, list[str] | None]] = [(fmt, None) for fmt in options.gguf]
    if options.quantized_cache:
        runs.append((options.gguf[0], Q8_CACHE))
    rows = []
    for fmt, cache_types in runs:
        method = llama_cpp_method(fmt, True, cache_types)
        progress(f"context {context}: {method}")
        request = {
            "model_path": str(gguf_path(options.model, fmt)),
            "n_ctx": replay_context(side["replays"], options.max_tokens), "threads": threads(), "flash_attn": True,
            "cache_types": cache_types, "reset_every_call": False, "reviews": side["replays"],
            "probes": replay_probes(side["probe_ids"]),
        }  # fmt: skip
        result = run_side_kept(LLAMACPP_SIDE, request, keep_in=options.keep_in, what=f"the llama.cpp run ({method})",
                               timeout_s=SIDE_TIMEOUT_S)  # fmt: skip
        rows.append(llama_cpp_row(context, method, result, gguf_format=fmt, cache_types=cache_types or ["f16", "f16"]))
    return rows


def _llama_server(options: SizesOptions, context: int, side: dict, progress: Progress) -> list[dict]:
    """llama-server's row at ``context`` on the first GGUF file, replaying this run's calls; none without
    ``--llama-server``."""
    if options.llama_server is None:
        return []
    first = options.gguf[0]
    return [
        llama_server_row(options.llama_server, gguf_path(options.model, first), first, context, side["replays"],
                         side["probe_ids"], options.max_tokens, progress)
    ]  # fmt: skip


def is_server(row: dict[str, Any]) -> bool:
    return row["method"].startswith("llama-server")


def borrowed_peers(
    path: Path, settings: dict[str, Any], ours: list[dict], *, server_measured: bool = False
) -> tuple[list[dict], Provenance]:
    """The llama.cpp rows of the earlier run at ``path`` (marked ``borrowed``) and its provenance, after checking
    that it ran the same protocol (:data:`SAME_RUN`) and the same work: as many calls, as many tokens decoded, per
    document. ``server_measured``: this run has its own llama-server row, so the earlier one's is left out."""
    earlier = SizesResult.model_validate_json(path.read_text())
    differ = [key for key in SAME_RUN if earlier.settings.get(key) != settings[key]]
    if differ:
        msg = f"--peers-from {path} ran other settings ({', '.join(differ)}): borrow only from the same protocol"
        raise ValueError(msg)
    peers = [
        row | {"borrowed": True}
        for row in earlier.rows
        if not is_ours(row) and not (server_measured and is_server(row))
    ]
    work = {r["context_tokens"]: (r["review_calls"], r["review_output_tokens"]) for r in ours}
    for row in peers:
        if (row["review_calls"], row["review_output_tokens"]) != work[row["context_tokens"]]:
            msg = f"{row['method']} in {path} did other work than ours: calls and tokens differ"
            raise ValueError(msg)
    return peers, earlier.provenance


def run_sizes(options: SizesOptions, progress: Progress = lambda _: None) -> SizesResult:
    runs_llama_cpp = options.peers_from is None
    if runs_llama_cpp:
        for fmt in options.gguf:
            gguf_path(options.model, fmt)  # every file there before anything is measured
        import llama_cpp  # noqa: F401  (the [peers] extra: fail before anything is measured)

    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.eval.corpus import pydoc_documents

    workflow = load_workflow("document_review", LANGGRAPH_JSON)
    roles = [*workflow.ROLE_PROMPTS, "procurement", "quality", "audit", "strategy", "data"][:AGENTS]
    texts = pydoc_documents(options.documents, chars_per_document=CHARS_PER_DOCUMENT)
    settings = {
        "model": options.model, "published_config": PUBLISHED[options.model], "random_weights": True,
        "contexts": list(options.contexts), "documents": options.documents, "roles": AGENTS,
        "max_tokens": options.max_tokens, "weights": list(options.weights), "threads": threads(),
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    for context in options.contexts:
        ours, side = _ours(options, context, texts, roles, progress)
        rows += ours + (_llama_cpp(options, context, side, progress) if runs_llama_cpp else [])
        rows += _llama_server(options, context, side, progress)
    peers_provenance = None
    settings["llama_server"] = options.llama_server is not None
    if runs_llama_cpp:
        settings |= {
            "gguf": list(options.gguf), "quantized_cache": options.quantized_cache,
            "llama_cpp_python": installed_version("llama-cpp-python"),
        }  # fmt: skip
    else:
        assert options.peers_from is not None
        server_measured = options.llama_server is not None
        peers, peers_provenance = borrowed_peers(options.peers_from, settings, rows, server_measured=server_measured)
        rows += peers
        settings["peers_from"] = options.peers_from.name
    return SizesResult(
        provenance=Provenance.of_this_process(), peers_provenance=peers_provenance, settings=settings, rows=rows
    )


def _cell(row: dict, key: str, fmt: str, unit: float = 1) -> str:
    return "—" if row.get(key) is None else fmt.format(row[key] / unit)


def _method(row: dict[str, Any]) -> str:
    """The row's method; ours with the weights its setting resolved to (``auto`` picks per machine)."""
    return f"{row['method']}, {row['weights']} weights" if is_ours(row) and "weights" in row else row["method"]


def _commit(provenance: Provenance | None) -> str:
    return (provenance.git_commit or "?")[:7] if provenance is not None else "?"


def markdown(result: SizesResult) -> str:
    """The run's table (each method's review wall, TTFT, decode, prefill, KV for the document, peak RSS), then
    the issue's three comparisons per context."""
    settings = result.settings
    commits = f"commit {_commit(result.provenance)}"
    if result.peers_provenance is not None:
        measured = "our rows and llama-server's" if any(
            is_server(r) and not r.get("borrowed") for r in result.rows
        ) else "our rows"  # fmt: skip
        commits = (
            f"{measured} at commit {_commit(result.provenance)}, llama-cpp-python's at "
            f"{_commit(result.peers_provenance)} (`{settings.get('peers_from')}`: the same calls and tokens per call, "
            "replaying that commit's answers)"
        )
    lines = [
        f"### {settings['model']} at {', '.join(f'{c:,}' for c in settings['contexts'])} tokens",
        "",
        f"{settings['model']} (published shapes, **random weights: time and memory only**), "
        f"{settings['documents']} documents, {settings['roles']} roles, {settings['max_tokens']} tokens per answer "
        f"(EOS ignored), {settings['threads']} threads, medians over the documents; {commits}.",
        "",
        "| context | method | review wall | TTFT scratch / cold / warm | decode tok/s, 1 / 15 agents | prefill tok/s "
        "| KV for the document | peak RSS: process / load and reviews |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.rows:
        kv = r.get("kv_bytes_resident")
        lines.append(
            f"| {r['context_tokens']:,} | {_method(r)} | {_cell(r, 'review_wall_s', '{:.1f} s')} "
            f"| {_cell(r, 'ttft_scratch_s', '{:.2f}')} / {_cell(r, 'ttft_cold_s', '{:.2f}')} / "
            f"{_cell(r, 'ttft_warm_s', '{:.2f} s')} | {_cell(r, 'decode_tok_s', '{:.1f}')} / "
            f"{_cell(r, 'decode_tok_s_15', '{:.1f}')} | {_cell(r, 'prefill_tok_s', '{:.0f}')} "
            f"| {'—' if kv is None else f'{kv / MIB:,.1f} MiB'} | {r['rss_peak_bytes'] / MIB:,.0f} / "
            f"{_cell(r, 'rss_peak_review_bytes', '{:,.0f}', MIB)} MiB |"
        )
    for context in settings["contexts"]:
        lines += ["", *comparisons([r for r in result.rows if r["context_tokens"] == context])]
    return "\n".join(lines) + "\n"


def comparisons(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 43's three targets at one context, from the rows measured: the review against llama.cpp's fastest
    method on each document, our KV against llama.cpp's q8_0 cache, our peak RSS against llama-server's plus the
    pool."""
    ours = next(r for r in rows if is_ours(r))
    peers = [r for r in rows if not is_ours(r)]
    context = f"{ours['context_tokens']:,} tokens"
    if not peers:
        return [f"- {context}: no llama.cpp row."]
    fastest = min(peers, key=lambda r: r["review_wall_s"])
    ratios = [p / o for p, o in zip(fastest["samples"]["review_wall_s"], ours["samples"]["review_wall_s"], strict=True)]
    lines = [
        f"- {context}, **review**: {fastest['method']}, the fastest peer, took {min(ratios):.1f}-{max(ratios):.1f}x "
        f"ours on each of {len(ratios)} documents (target: 3x)."
    ]
    quantized = [r for r in peers if r.get("cache_types", ["f16"])[0] != "f16" and r.get("kv_bytes_resident")]
    kv = ours["kv_bytes_resident"]
    if quantized:
        theirs = quantized[0]["kv_bytes_resident"]
        verdict = "met" if kv <= theirs else "not met"
        lines.append(
            f"- {context}, **KV for the document**: ours {kv / MIB:,.1f} MiB against {theirs / MIB:,.1f} MiB with "
            f"llama.cpp's {'/'.join(quantized[0]['cache_types'])} cache ({kv / theirs:.2f}x; target <= 1: {verdict})."
        )
    # The peers' processes run the reviews and the decode, not our probe's extra caches.
    ours_peak = ours.get("rss_peak_review_bytes") or ours["rss_peak_bytes"]
    what = "the load and the reviews" if ours.get("rss_peak_review_bytes") else "the process"
    servers = [r for r in peers if is_server(r)]
    if servers:
        server = servers[0]["rss_peak_bytes"]
        verdict = "met" if ours_peak <= server + ours["kv_bytes"] else "not met"
        lines.append(
            f"- {context}, **peak RSS**: ours {ours_peak / MIB:,.0f} MiB ({what}) against llama-server's "
            f"{server / MIB:,.0f} MiB plus the pool's {ours['kv_bytes'] / MIB:,.1f} (target: {verdict})."
        )
        lowest = min(peers, key=lambda r: r["rss_peak_bytes"])
        if lowest["rss_peak_bytes"] < ours_peak:  # the target's peer is not always the smallest process
            lines.append(
                f"- {context}, **the smallest process**: {lowest['method']}, {lowest['rss_peak_bytes'] / MIB:,.0f} "
                f"MiB at its peak, below ours."
            )
    else:
        processes = [r["rss_peak_bytes"] for r in peers]
        verdict = "below every one of them" if ours_peak <= min(processes) else "llama.cpp holds less"
        lines.append(
            f"- {context}, **peak RSS**: no llama-server row, the target's peer; ours {ours_peak / MIB:,.0f} MiB "
            f"({what}) against {min(processes) / MIB:,.0f}-{max(processes) / MIB:,.0f} MiB for llama-cpp-python's "
            f"processes ({verdict})."
        )
    return lines


def _runs(results_dir: Path) -> list[SizesResult]:
    paths = sorted((results_dir / FOLDER).glob("*.json"))
    return [SizesResult.model_validate_json(path.read_text()) for path in paths]


def render(results_dir: Path) -> Rendered | None:
    runs = _runs(results_dir)
    if not runs:
        return None
    lines = [
        "## At the sizes users run: 1B+ parameters against llama.cpp",
        "",
        f"Produced by `{COMMAND}`; every run under `benchmarks/results/{FOLDER}/`.",
        "",
        "Models of published shapes (benchmarks/real_shapes.py) with **random weights from a fixed seed: time and "
        "memory only, meaningless for quality**; llama.cpp's GGUF files are made from the same weights by its own "
        "converter and quantizer. Every method decodes the same number of tokens from the same prompts.",
    ]
    block: list[str] = []
    for run in runs:
        table = markdown(run)
        (results_dir / FOLDER / f"{_stem(run.settings)}.md").write_text(table, encoding="utf-8")
        lines += ["", *table.rstrip("\n").split("\n")]
        block += [*table.rstrip("\n").split("\n")[2:], ""]  # the README's own heading stands above it
    return Rendered(
        results=lines,
        blocks={"sizes": "\n".join(block)},
        provenance=[run.provenance for run in runs],
        parts={"peers": [run.peers_provenance for run in runs if run.peers_provenance is not None]},
    )


def _stem(settings: dict[str, Any]) -> str:
    return f"{settings['model']}_{'_'.join(str(c) for c in settings['contexts'])}"


COMMAND = (
    "python -m benchmarks sizes --model Llama-3.2-1B --context 8192 --documents 3 --gguf Q8_0 --gguf Q4_0 "
    "--quantized-cache --llama-server LLAMA_SERVER"
)


class SizesSuite:
    name = "sizes"
    summary = (
        "The 15-role review on 1B+ models of published shapes (random weights: time and memory only) against "
        "llama.cpp and llama-server, every method in its own process."
    )
    options = SizesOptions
    reproduce = ()  # needs the [peers] extra, the models' GGUF files and hours: run by hand, as its section says

    def run(self, options: SizesOptions, progress: Progress) -> SizesResult:
        return run_sizes(options, progress)

    def write(self, result: SizesResult, out_dir: Path) -> list[Path]:
        folder = out_dir / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{_stem(result.settings)}.json"
        path.write_text(json.dumps(result.model_dump(mode="json"), indent=1) + "\n", encoding="utf-8")
        table = path.with_suffix(".md")
        table.write_text(markdown(result), encoding="utf-8")
        return [path, table]

    def render(self, results_dir: Path) -> Rendered | None:
        return render(results_dir)


SUITE = SizesSuite()
