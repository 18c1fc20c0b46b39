"""``python -m benchmarks serve_peers``: ``polykv-agents bench serve``'s workflows, and the same workflows served by
llama.cpp, side by side in one run.

Ours: :func:`polykv_agents.bench.serve.run_serve` (N review workflows over N documents, each (N, mode) in a
fresh process: at once, one after another, and through ``langgraph dev``). The peers replay the token ids our
workflows read, recorded over the same documents, roles and run context
(:mod:`benchmarks.studies.serve_record_side`); every call decodes greedily as many tokens as ours did
(``ignore_eos``), with the same threads and the same GGUF file:

- **llama-server, N slots** (:mod:`benchmarks.studies.llama_server`): one slot per workflow, which serves every
  call of its workflow (``id_slot``) and so keeps its document, each slot with a KV cache of its own
  (``--no-kv-unified``), its prompt cache and ``--cache-reuse``; the N workflows started together, each sending
  its calls stage by stage (its specialists at once, queued on its slot), as N LangGraph clients of an
  OpenAI-compatible server would. ``--no-pin-slots --unified-kv`` gives the configuration measured up to
  a297176, where at N = 8 each workflow's calls evaluated 45% of their prompt tokens again (slots taking calls
  over other documents). Pinned slots over one unified cache did worse still (8 slots, each given its own
  2,048-token document, then 8 pinned completions of 32 tokens at once: each evaluated its whole document
  again, 5.3 tok/s aggregate, against 68 tok/s and 2-3 prompt tokens each with a cache per slot; 2026-12-06,
  this machine type, llama.cpp of llama-cpp-python 0.3.36, F16);
- **llama.cpp, one after another** (:mod:`benchmarks.studies.llamacpp_side`, llama-cpp-python): the N workflows
  in turn over one context, its prefix reuse keeping the document between a workflow's calls.

Each peer runs in a process of its own (the server; the llama.cpp side), so each peak RSS is its own. The peers
do not stream, so they have no TTFT. Results: ``serve_peers.json`` (our rows, then the peers').
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import Field, FilePath, model_validator

from benchmarks.studies.llama_server import LlamaServer, replay_review, server_peak_rss_bytes
from benchmarks.studies.side_process import run_side
from polykv_agents.bench.output import MIB, Progress, SuiteResult, write_suite
from polykv_agents.bench.serve import (
    MODE_LABELS,
    ServeOptions,
    run_serve,
    serve_columns,
    serve_note,
    serve_texts,
    speedups,
    summary_row,
    worker_request,
    write_serve,
)
from polykv_agents.bench.serve_worker import start_together
from polykv_agents.bench.suite import TableSuite

RECORD_SIDE = Path(__file__).with_name("serve_record_side.py")
LLAMACPP_SIDE = Path(__file__).with_name("llamacpp_side.py")
SIDE_TIMEOUT_S = 3 * 3600
PEER_LABELS = {
    "llama_server": "llama-server, N slots, at once",
    "llamacpp_one_after_another": "llama.cpp, prefix reuse, one after another",
}


class ServePeersOptions(ServeOptions):
    llama_server: FilePath | None = None
    """The llama-server binary (built from the llama-cpp-python sdist's llama.cpp, see docs/RESULTS.md)."""
    gguf: FilePath | None = None
    """The GGUF file llama.cpp reads (default: the embedded model's own, Q4_1, the file ours loads)."""
    flash_attn: bool = True
    """llama.cpp's flash attention, on both peers."""
    cache_reuse: int = Field(default=256, ge=0)
    """llama-server's ``--cache-reuse`` (the smallest chunk of a slot's cache it shifts into place; 0: off)."""
    pin_slots: bool = True
    """llama-server: each workflow's calls go to its own slot (``id_slot``), so a slot keeps its workflow's
    document. Off: any idle slot takes any call."""
    unified_kv: bool = False
    """llama-server: one KV cache shared by the slots (``--kv-unified``); off (the default, measured faster
    above), each slot has one of its own (``--no-kv-unified``)."""

    @model_validator(mode="after")
    def _needs_the_server(self) -> ServePeersOptions:
        if self.llama_server is None:
            msg = "serve_peers needs --llama-server PATH (llama.cpp's server, built as docs/RESULTS.md says)"
            raise ValueError(msg)
        return self


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _context_size(workflows: list[list[dict]], max_tokens: int) -> int:
    """Tokens one workflow's context needs: its longest call, what it decodes, and a margin."""
    return max(len(c["input_ids"]) for calls in workflows for c in calls) + max_tokens + 64


def _gguf(options: ServePeersOptions) -> Path:
    from polykv_agents.model.loading import embedded_model_file

    return options.gguf or embedded_model_file()


def llama_server_at_once(options: ServePeersOptions, workflows: list[list[dict]]) -> dict[str, Any]:
    """The workflows started together on a llama-server with one slot each: per workflow its latency (from the
    common start) and output tokens, and what the server's prompt cache left it to evaluate."""

    def replayed(job: tuple[int, list[dict]], started: float) -> dict[str, Any]:
        slot, calls = job
        replay = replay_review(server, calls, slot if options.pin_slots else None)
        return {
            "latency_s": time.perf_counter() - started,
            "ttft_s": None,
            "output_tokens": replay["output_tokens"],
            "prompt_tokens_evaluated": replay["prompt_tokens_evaluated"],
            "prompt_tokens": replay["prompt_tokens"],
        }

    with LlamaServer(
        options.llama_server, _gguf(options), slots=len(workflows),
        ctx_per_slot=_context_size(workflows, options.max_tokens), threads=_threads(), flash_attn=options.flash_attn,
        cache_reuse=options.cache_reuse, unified_kv=options.unified_kv,
    ) as server:  # fmt: skip
        server.complete(workflows[0][0]["input_ids"][:64], 2)  # warm-up: first passes and allocations
        runs, wall = start_together(replayed, list(enumerate(workflows)))
        return {"runs": runs, "wall_s": wall, "rss_peak_bytes": server_peak_rss_bytes(server)}


def llamacpp_one_after_another(options: ServePeersOptions, workflows: list[list[dict]]) -> dict[str, Any]:
    """The workflows in turn on llama-cpp-python, each from an empty context, its calls over one context."""
    request = {
        "model_path": str(_gguf(options)), "n_ctx": _context_size(workflows, options.max_tokens),
        "threads": _threads(), "flash_attn": options.flash_attn, "reset_every_call": False, "reviews": workflows,
        "probes": [],
    }  # fmt: skip
    result = run_side(LLAMACPP_SIDE, request, what="the llama.cpp serving run", timeout_s=SIDE_TIMEOUT_S)
    reviews = result["reviews"]  # each from its own start, as ours one after another
    runs = [{"latency_s": r["wall_s"], "ttft_s": None, "output_tokens": r["output_tokens"]} for r in reviews]
    return {"runs": runs, "wall_s": sum(r["wall_s"] for r in reviews), "rss_peak_bytes": result["rss_peak_bytes"]}


def run_serve_peers(options: ServePeersOptions, progress: Progress = lambda _: None) -> SuiteResult:
    from importlib.metadata import version

    ours = run_serve(options, progress)
    progress("recording the workflows' calls")
    request = worker_request(options, serve_texts(options), "one_after_another")
    recorded = run_side(RECORD_SIDE, request, what="recording the workflows", timeout_s=SIDE_TIMEOUT_S)["workflows"]
    rows = list(ours.rows)
    for workflows in options.workflows:
        progress(f"{workflows} workflow(s): {PEER_LABELS['llama_server']}")
        rows.append(summary_row(workflows, "llama_server", llama_server_at_once(options, recorded[:workflows])))
        progress(f"{workflows} workflow(s): {PEER_LABELS['llamacpp_one_after_another']}")
        measured = llamacpp_one_after_another(options, recorded[:workflows])
        rows.append(summary_row(workflows, "llamacpp_one_after_another", measured))
    settings = {
        **ours.settings, "gguf": _gguf(options).name, "flash_attn": options.flash_attn,
        "cache_reuse": options.cache_reuse, "pin_slots": options.pin_slots,
        "unified_kv": options.unified_kv,
        "llama_cpp_python": version("llama-cpp-python"), "threads": _threads(),
    }  # fmt: skip
    return SuiteResult(
        suite="serve_peers", info=ours.info, settings=settings, rows=rows, summary=ours.summary | versus_peers(rows)
    )


def versus_peers(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per N: our aggregate tokens/s with the N workflows at once over each peer's."""
    by = {(r["workflows"], r["mode"]): r for r in rows}
    summary = {}
    for (workflows, mode), row in by.items():
        ours = by.get((workflows, "at_once"))
        if mode in PEER_LABELS and ours is not None:
            summary[f"at_once_vs_{mode}_{workflows}_x"] = ours["aggregate_tok_s"] / row["aggregate_tok_s"]
    return summary


def _slots_said(settings: dict[str, Any]) -> str:
    """How the server's slots were used (runs from before these settings: one unified KV cache, unpinned)."""
    kv = "`--kv-unified`" if settings.get("unified_kv", True) else "a KV cache per slot (`--no-kv-unified`)"
    if settings.get("pin_slots", False):
        return (
            f"{kv}, every call of a workflow sent to its slot (`id_slot`; a workflow's specialists queue on its slot, "
            "which keeps its document)"
        )
    return f"{kv}, any idle slot taking any call"


def peers_note(result: SuiteResult) -> str:
    settings = result.settings
    return (
        f"The peers replay the token ids of our workflows' calls (recorded one after another over the same documents, "
        f"roles and run context), each call decoding as many tokens as ours did; llama.cpp "
        f"(llama-cpp-python {settings['llama_cpp_python']} and llama-server from the same sources) reads "
        f"`{settings['gguf']}` with {settings['threads']} threads, flash attention "
        f"{'on' if settings['flash_attn'] else 'off'}. llama-server: one slot per workflow, "
        f"{_slots_said(settings)}, prompt cache, `--cache-reuse {settings['cache_reuse']}`, the N workflows started "
        "together, each sending its calls stage by stage (its specialists at once). llama.cpp: the N workflows one "
        "after another over one context, "
        "its prefix reuse keeping the document between a workflow's calls. The peers do not stream (no TTFT); each "
        "peak RSS is that engine's own process."
    )


def our_result(result: SuiteResult) -> SuiteResult:
    """Our rows of a run, as ``polykv-agents bench serve`` writes them (the same measurement)."""
    rows = [r for r in result.rows if r["mode"] in MODE_LABELS]
    settings = {key: result.settings[key] for key in ("context", "roles", "max_tokens", "graph")}
    return SuiteResult(suite="serve", info=result.info, settings=settings, rows=rows, summary=speedups(rows))


def write_serve_peers(result: SuiteResult, out_dir: Path) -> list[Path]:
    """``serve_peers``' files, and ``bench serve``'s from our rows, unless they hold another run (a ``bench serve``
    of its own, which this run's rendering must not overwrite)."""
    columns = serve_columns(result, {**MODE_LABELS, **PEER_LABELS})
    notes = [serve_note(result), peers_note(result)]
    title = "Many workflows at once, against llama.cpp"
    written = write_suite(result, out_dir, title=title, columns=columns, notes=notes)
    ours, theirs = our_result(result), out_dir / "serve.json"
    if not theirs.exists() or SuiteResult.load(theirs).info == ours.info:
        written += write_serve(ours, out_dir)
    return written


def readme_block(result: SuiteResult) -> dict[str, str]:
    """The README's table: per N, aggregate tokens/s of ours at once and of each peer, our gains, p95, peak RSS."""
    by = {(r["workflows"], r["mode"]): r for r in result.rows}
    lines = [
        "| workflows | tok/s, ours at once / one after another | llama-server, N slots | llama.cpp, one after another "
        "| ours at once vs one after another / vs llama-server / vs llama.cpp | p95 latency at once "
        "| peak RSS, ours / llama-server |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def rate(workflows: int, mode: str) -> str:
        row = by.get((workflows, mode))
        return "—" if row is None else f"{row['aggregate_tok_s']:.1f}"

    def ratio(key: str) -> str:
        value = result.summary.get(key)
        return "—" if value is None else f"{value:.2f}x"

    for workflows in sorted({w for w, _ in by}):
        gains = " / ".join(
            ratio(key)
            for key in (
                f"at_once_{workflows}_throughput_x",
                f"at_once_vs_llama_server_{workflows}_x",
                f"at_once_vs_llamacpp_one_after_another_{workflows}_x",
            )
        )
        at_once, server = by.get((workflows, "at_once")), by.get((workflows, "llama_server"))
        p95 = "—" if at_once is None else f"{at_once['latency_p95_s']:.1f} s"
        rss = " / ".join("—" if r is None else f"{r['rss_peak_bytes'] / MIB:,.0f} MiB" for r in (at_once, server))
        lines.append(
            f"| {workflows} | {rate(workflows, 'at_once')} / {rate(workflows, 'one_after_another')} "
            f"| {rate(workflows, 'llama_server')} | {rate(workflows, 'llamacpp_one_after_another')} | {gains} "
            f"| {p95} | {rss} |"
        )
    return {"serve_peers": "\n".join(lines)}


SUITE = TableSuite(
    "serve_peers",
    "bench serve's N workflows over N documents (at once, one after another, through langgraph dev) against "
    "llama-server with N slots and llama.cpp one after another, replaying the same token ids: aggregate tokens/s, "
    "latency, peak RSS.",
    ServePeersOptions,
    run_serve_peers,
    write_serve_peers,
    command="python -m benchmarks serve_peers --llama-server LLAMA_SERVER",
    blocks=readme_block,
    reproduce=(),  # needs the [peers] extra and a llama-server binary
)
