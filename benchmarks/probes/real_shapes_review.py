"""Probe: the 15-role review on a model of a size users run (1B+ parameters, random weights), against llama.cpp.

The peers' protocol (:mod:`benchmarks.studies.peers`) on a model of :mod:`benchmarks.real_shapes`: every method in
a fresh process of its own, the same documents (pydoc texts), the same prompts and the same number of tokens per
call (EOS ignored), llama.cpp replaying our recorded calls token for token over one context, so its prefix reuse
keeps the document. Per method and context: the review's wall and stage times, TTFT from scratch / cold / warm,
decode speed for 1 and 15 agents, prefill speed, the KV bytes held for the document and the peak RSS
(``VmHWM``, model load included).

- **ours**: the review graph with one pool (``--weights``, repeatable; ``auto`` is the default);
- **llama.cpp** (llama-cpp-python), flash attention on, prefix reuse, one row per GGUF file (``--gguf``, made by
  llama.cpp's own converter and quantizer from the same random weights), and with ``--quantized-cache`` one more
  row on the first file with its KV cache in q8_0 (keys and values), the peer for the pool's bytes;
- **llama-server** (``--llama-server``), one slot, prompt cache, on the first file.

**Random weights are meaningless for quality**: the figures are time and memory only. The answers are noise;
every method decodes the same number of tokens from the same prompts. Writes ``--out`` (JSON, with the commit
and machine) and the Markdown table beside it:

    LLAMA_CPP_LIB_PATH=B python -m benchmarks.probes.real_shapes_review --model Llama-3.2-1B --context 8192 \\
        --gguf Q8_0 --gguf Q4_0 --quantized-cache --llama-server B/llama-server \\
        --keep-in KEEP --out benchmarks/results/issue43/review_Llama-3.2-1B.json

The GGUF files must exist (``python -m benchmarks.real_shapes --model M --llama-cpp SRC --gguf Q8_0 ...``).
``--ours-only`` measures our rows alone, to set a later commit's beside a run's llama.cpp rows (whose side did not
change).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.real_shapes import GGUF_TYPES, PUBLISHED, model_dir
from benchmarks.studies.peers import (
    AGENTS,
    SERVER_SLOTS,
    engine_row,
    llama_cpp_method,
    our_method,
    probe_samples,
    review_samples,
)
from benchmarks.studies.side_process import run_side_kept
from benchmarks.studies.workflows import LANGGRAPH_JSON

OURS_SIDE = Path(__file__).with_name("real_shapes_ours.py")
LLAMACPP_SIDE = Path(__file__).parents[1] / "studies" / "llamacpp_side.py"
SIDE_TIMEOUT_S = 4 * 3600
Q8_CACHE = ["q8_0", "q8_0"]
"""llama.cpp's KV cache in q8_0, keys and values (``--cache-type-k q8_0 --cache-type-v q8_0``): the issue's peer for
the pool's bytes at these sizes."""


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


def _extra(side: dict[str, Any]) -> dict[str, Any]:
    reviews = side["reviews"]
    return {
        "review_calls": reviews[0]["calls"] if reviews else 0,
        "review_output_tokens": [r["output_tokens"] for r in reviews],
        "rss_peak_bytes": side["rss_peak_bytes"],
        "rss_after_load_bytes": side.get("rss_after_load_bytes"),
        "load_s": side.get("load_s"),
    }


def ours_rows(args, context: int, texts: list[str], roles: list[str], progress) -> tuple[list[dict], dict]:
    """Our rows at ``context``, a process per weights setting; the first setting's side result (its calls)."""
    rows, first = [], None
    for weights in args.weights:
        method = our_method(weights)
        progress(f"context {context}: {method}")
        request = {
            "model": str(model_dir(args.model)), "weights": weights, "graphs": str(LANGGRAPH_JSON),
            "max_tokens": args.max_tokens, "roles": roles, "context": context, "texts": texts,
        }  # fmt: skip
        side = run_side_kept(OURS_SIDE, request, keep_in=args.keep_in, what=f"our run ({method})",
                             timeout_s=SIDE_TIMEOUT_S)  # fmt: skip
        first = first or side
        samples = {**review_samples(side["reviews"]), **probe_samples(side["probes"])}
        rows.append(engine_row(context, method, samples, weights=side["weights"], **_extra(side)))
    return rows, first


def llama_cpp_rows(args, context: int, side: dict, threads: int, progress) -> list[dict]:
    """llama.cpp's rows at ``context``: each GGUF file, flash attention on; the q8_0 cache on the first file."""
    n_ctx = max(len(c["input_ids"]) for replay in side["replays"] for c in replay) + args.max_tokens + 64
    keys = ("document_ids", "prompt_ids", "other_prompt_ids", "decode_tokens")
    probes = [{k: ids[k] for k in keys} for ids in side["probe_ids"]]
    runs: list[tuple[str, list[str] | None]] = [(fmt, None) for fmt in args.gguf]
    if args.quantized_cache:
        runs.append((args.gguf[0], Q8_CACHE))
    rows = []
    for fmt, cache_types in runs:
        method = llama_cpp_method(fmt, True, cache_types)
        progress(f"context {context}: {method}")
        request = {
            "model_path": str(gguf_path(args.model, fmt)), "n_ctx": n_ctx, "threads": threads, "flash_attn": True,
            "cache_types": cache_types, "reset_every_call": False, "reviews": side["replays"], "probes": probes,
        }  # fmt: skip
        result = run_side_kept(LLAMACPP_SIDE, request, keep_in=args.keep_in, what=f"the llama.cpp run ({method})",
                               timeout_s=SIDE_TIMEOUT_S)  # fmt: skip
        samples = {**review_samples(result["reviews"]), **probe_samples(result["probes"])}
        samples["kv_bytes"] = samples["kv_bytes_resident"] = [p["state_bytes"] for p in result["probes"]]
        rows.append(
            engine_row(context, method, samples, gguf_format=fmt, cache_types=cache_types or ["f16", "f16"],
                       **_extra(result))
        )  # fmt: skip
    return rows


def llama_server_row(args, context: int, side: dict, threads: int, progress) -> dict:
    """llama-server's row at ``context`` on the first GGUF file: one slot, the review, then the 15-agent decode with
    the slot holding the document (as the peers run it)."""
    from benchmarks.studies.llama_server import (
        LlamaServer,
        aggregate_decode,
        replay_review,
        server_peak_rss_bytes,
        warm_slots,
    )

    replays, probe_ids, fmt = side["replays"], side["probe_ids"], args.gguf[0]
    n_ctx = max(len(c["input_ids"]) for replay in replays for c in replay) + args.max_tokens + 64
    method = f"llama-server ({fmt}), 1 slot, prompt cache"
    progress(f"context {context}: {method}")
    with LlamaServer(args.llama_server, gguf_path(args.model, fmt), slots=SERVER_SLOTS, ctx_per_slot=n_ctx,
                     threads=threads, flash_attn=True) as server:  # fmt: skip
        server.complete(replays[0][0]["input_ids"][:64], 2)  # warm-up
        reviews = [replay_review(server, replay) for replay in replays]
        aggregates = []
        for ids in probe_ids:
            warm_slots(server, ids["document_ids"], SERVER_SLOTS)
            aggregates.append(aggregate_decode(server, ids["agent_prompts"], args.max_tokens))
        rss_peak = server_peak_rss_bytes(server)
    samples = {**review_samples(reviews), "decode_tok_s_15": [a["decode_tok_s_15"] for a in aggregates]}
    return engine_row(
        context, method, samples, gguf_format=fmt, review_calls=reviews[0]["calls"],
        review_output_tokens=[r["output_tokens"] for r in reviews], rss_peak_bytes=rss_peak,
        prompt_tokens_evaluated=reviews[0]["prompt_tokens_evaluated"],
    )  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    """One table: each method's review wall, TTFT, decode, prefill, KV for the document, peak RSS."""

    def cell(row: dict, key: str, fmt: str) -> str:
        return "—" if row.get(key) is None else fmt.format(row[key])

    settings = result["settings"]
    lines = [
        f"{settings['model']} (published shapes, **random weights: time and memory only**), "
        f"{settings['documents']} documents, {settings['roles']} roles, {settings['max_tokens']} tokens per answer "
        f"(EOS ignored), medians over the documents; commit {(result['provenance'].get('git_commit') or '?')[:7]}.",
        "",
        "| context | method | review wall | TTFT scratch / cold / warm | decode tok/s, 1 / 15 agents | prefill tok/s "
        "| KV for the document | peak RSS |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        kv = r.get("kv_bytes_resident")
        lines.append(
            f"| {r['context_tokens']:,} | {r['method']} | {cell(r, 'review_wall_s', '{:.1f} s')} "
            f"| {cell(r, 'ttft_scratch_s', '{:.2f}')} / {cell(r, 'ttft_cold_s', '{:.2f}')} / "
            f"{cell(r, 'ttft_warm_s', '{:.2f} s')} | {cell(r, 'decode_tok_s', '{:.1f}')} / "
            f"{cell(r, 'decode_tok_s_15', '{:.1f}')} | {cell(r, 'prefill_tok_s', '{:.0f}')} "
            f"| {'—' if kv is None else f'{kv / 2**20:,.1f} MiB'} | {r['rss_peak_bytes'] / 2**20:,.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(PUBLISHED), default="Llama-3.2-1B")
    parser.add_argument("--context", type=int, action="append", help="document tokens (repeatable; default 8192)")
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--weights", action="append", help="ours: auto (default), native, int8, int4 (repeatable)")
    parser.add_argument("--gguf", action="append", choices=GGUF_TYPES, help="llama.cpp's files (default Q8_0, Q4_0)")
    parser.add_argument("--quantized-cache", action="store_true", help="one more row: the first file, q8_0 cache")
    parser.add_argument("--llama-server", type=Path, help="the llama-server binary; without it, no server row")
    parser.add_argument("--ours-only", action="store_true", help="our rows only, to set beside a run's llama.cpp rows")
    parser.add_argument("--keep-in", type=Path, help="keep each side's result here, to resume a stopped run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.context = args.context or [8192]
    args.weights = args.weights or ["auto"]
    args.gguf = args.gguf or ["Q8_0", "Q4_0"]
    if args.ours_only and (args.quantized_cache or args.llama_server):
        parser.error("--ours-only measures no llama.cpp row: drop --quantized-cache and --llama-server")
    if args.ours_only:
        args.gguf = []
    for fmt in args.gguf:
        gguf_path(args.model, fmt)  # every file there before anything is measured
    if args.gguf:
        import llama_cpp  # noqa: F401  (the [peers] extra: fail before anything is measured)

    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.bench.provenance import Provenance
    from polykv_agents.eval.corpus import pydoc_documents

    def progress(message: str) -> None:
        print(message, flush=True)

    workflow = load_workflow("document_review", LANGGRAPH_JSON)
    roles = [*workflow.ROLE_PROMPTS, "procurement", "quality", "audit", "strategy", "data"][:AGENTS]
    # Longer texts than the peers' 60,000 characters: 16K tokens of SmolLM2's tokenizer need about 70,000.
    texts = pydoc_documents(args.documents, chars_per_document=120_000)
    threads = _threads()
    rows: list[dict[str, Any]] = []
    for context in args.context:
        our_rows, side = ours_rows(args, context, texts, roles, progress)
        rows += our_rows + (llama_cpp_rows(args, context, side, threads, progress) if args.gguf else [])
        if args.llama_server is not None:
            rows.append(llama_server_row(args, context, side, threads, progress))
    from importlib.metadata import version

    result = {
        "probe": "real_shapes_review",
        "provenance": Provenance.of_this_process().model_dump(mode="json"),
        "settings": {
            "model": args.model, "published_config": PUBLISHED[args.model], "random_weights": True,
            "contexts": args.context, "documents": args.documents, "roles": AGENTS, "max_tokens": args.max_tokens,
            "weights": args.weights, "gguf": args.gguf, "quantized_cache": args.quantized_cache,
            "llama_server": args.llama_server is not None, "threads": threads,
            "llama_cpp_python": version("llama-cpp-python") if args.gguf else None,
        },
        "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
