"""Render docs/RESULTS.md from the JSON that the benchmark scripts wrote.

    python benchmarks/render_results.py

Reads benchmarks/results/{perplexity_sweep,pool_build}.json; writes nothing but docs/RESULTS.md.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _stdev(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def perplexity_section(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    contexts = sorted({r["context"] for r in rows})
    configs = list(dict.fromkeys(r["config_name"] for r in rows))
    lines = [
        "## Perplexity: pooled vs full-precision cache",
        "",
        f"Machine: {meta['machine']}, torch {meta['torch']}. Model: {meta['model']} ({meta['dtype']}). "
        f"Text: {meta['corpus']}; {meta['documents']} documents per context length; perplexity of the "
        f"{meta['continuation_tokens']} tokens after the prefix. One prefill per (document, context); every "
        "config is compressed from that same cache. Scoring is teacher-forced and deterministic, so one "
        "repetition per cell. "
        f"Wall time {meta['wall_s'] / 60:.0f} min.",
        "",
        "`delta` = 100 x (ppl_pool - ppl_full) / ppl_full, mean over documents (sd, min .. max). "
        "Pool size and ratio are measured from the stored tensors.",
        "",
        "| context tokens | config | delta % mean (sd) | min .. max | pool MiB | x vs fp16 |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for context in contexts:
        for name in configs:
            sel = [r for r in rows if r["context"] == context and r["config_name"] == name]
            deltas = [r["delta_pct"] for r in sel]
            lines.append(
                f"| {context} | {name} | {statistics.mean(deltas):+.3f} ({_stdev(deltas):.3f}) "
                f"| {min(deltas):+.3f} .. {max(deltas):+.3f} | {sel[0]['pool_nbytes'] / 2**20:.2f} "
                f"| {sel[0]['compression_ratio']:.2f} |"
            )
    return lines


def pool_build_section(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    lines = [
        "## Pool size and build / decompress time",
        "",
        f"Machine: {meta['machine']}, torch {meta['torch']}. Model: {meta['model']} ({meta['dtype']}). "
        f"Document: {meta['document']}. Median of {meta['repetitions']} runs after {meta['warmup_runs']} warm-up. "
        f"Process peak RSS {meta['peak_rss_bytes'] / 2**30:.2f} GiB.",
        "",
        "| context tokens | config | pool MiB | fp16 cache MiB | fp32 cache MiB | x vs fp16 | prefill s "
        "| compress s (% of prefill) | decompress s (% of prefill) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['config_label']} | {r['pool_nbytes'] / 2**20:.2f} | {r['fp16_nbytes'] / 2**20:.2f} "
            f"| {r['model_dtype_nbytes'] / 2**20:.2f} | {r['compression_ratio_vs_fp16']:.3f} "
            f"| {r['median_prefill_s']:.2f} | {r['median_compress_s']:.3f} ({r['compress_pct_of_prefill']:.1f}%) "
            f"| {r['median_decompress_s']:.3f} ({r['decompress_pct_of_prefill']:.1f}%) |"
        )
    return lines


def agents_section(results: list[dict]) -> list[str]:
    first = results[0]
    lines = [
        "## Many agents at once: batched runtime vs sequential vs naive batching",
        "",
        f"Machine: x86_64, {first['threads']} torch threads, CPU. Model: {first['model_name']} "
        f"({first['dtype']}; every baseline runs in the same dtype). {first['agents']} agents, "
        f"{first['max_new_tokens']} tokens each (EOS ignored, so every method decodes the same tokens). "
        f"Median of {first['repetitions']} runs after 1 warm-up. "
        "Document: pydoc_data.topics (CPython), cut to the context length.",
        "",
        "- `batched`: the runtime (one shared decoded prefix, cascade attention, one batched forward per step);",
        "- `sequential`: the same agents one after another, each alone over a private decoded copy of the pool;",
        "- `naive batched`: one batched forward per step over the decoded prefix copied once per agent;",
        "- TTFT: one agent's first token from the pool, vs prefilling document + question (a plain chat model).",
        "",
        "| context | prefix residency | KV peak, runtime | KV peak, naive | tok/s batched | tok/s sequential "
        "| tok/s naive batched | TTFT pool | TTFT re-prefill | process peak RSS |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['context_tokens']} | {r['runtime']} | {r['kv_bytes_pooled_peak'] / 2**20:.1f} MiB "
            f"| {r['kv_bytes_naive_peak'] / 2**20:.1f} MiB "
            f"| {r['throughput_tok_s_batched']:.1f} | {r['throughput_tok_s_sequential']:.1f} "
            f"| {r['throughput_tok_s_naive_batched']:.1f} | {r['ttft_s_pool']:.3f} s | {r['ttft_s_reprefill']:.2f} s "
            f"| {r['rss_peak_bytes'] / 2**30:.2f} GiB |"
        )
    lines += [
        "",
        "| context | prefix residency | KV memory: naive / runtime | batched / sequential | batched / naive "
        "| TTFT speed-up |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['context_tokens']} | {r['runtime']} | {r['kv_bytes_naive_peak'] / r['kv_bytes_pooled_peak']:.1f}x "
            f"| {r['throughput_tok_s_batched'] / r['throughput_tok_s_sequential']:.1f}x "
            f"| {r['throughput_tok_s_batched'] / r['throughput_tok_s_naive_batched']:.1f}x "
            f"| {r['ttft_s_reprefill'] / r['ttft_s_pool']:.0f}x |"
        )
    return lines


def graph_section(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    lines = [
        "## End to end: the document-review graph",
        "",
        f"Machine: {meta['machine']}, torch {meta['torch']}. Model: {meta['model']} ({meta['dtype']}). "
        f"{meta['calls_per_run']} model calls per run (planner, specialists in parallel, critic, summarizer). "
        f"Median of {meta['repetitions']} runs after {meta['warmup_runs']} warm-up. Document: {meta['document']}. "
        "The pooled graph builds its pool inside every run; the baseline (`build_graph(share_pool=False)`) "
        "prefills the document in every call.",
        "",
        "| context | roles | tokens per answer | wall, pooled | wall, re-prefill | speed-up "
        "| output tokens (pooled / re-prefill) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context_tokens']} | {r['roles']} | {r['max_tokens']} | {r['wall_s_pooled']:.1f} s "
            f"| {r['wall_s_reprefill']:.1f} s | {r['speedup']:.1f}x | {r['output_tokens_pooled']:.0f} / "
            f"{r['output_tokens_reprefill']:.0f} |"
        )
    return lines


def main() -> None:
    lines = [
        "# Results",
        "",
        "Generated by `python benchmarks/render_results.py` from the JSON in `benchmarks/results/`; each "
        "section names the script that produced its data. Every figure is measured: sizes are `nbytes` of "
        "real tensors, ratios come from one run side by side.",
        "",
    ]
    sweep, build = _load("perplexity_sweep"), _load("pool_build")
    if build:
        lines += ["Produced by `python benchmarks/pool_build.py --contexts 2048 4096 --repetitions 3`.", ""]
        lines += [*pool_build_section(build), ""]
    agents = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("agents_*.json")) if p.stat().st_size]
    if agents:
        lines += [
            "Produced by `polykv-agents bench agents --document DOC --agents 15 --context-tokens T --max-new-tokens 32 "
            "--repetitions 3 --json` for T in 2048 and 4096, and with `--runtime compressed` at 2048 (DOC: the first "
            "60k characters of pydoc_data.topics).",
            "",
        ]
        lines += [*agents_section(sorted(agents, key=lambda r: (r["context_tokens"], r["runtime"]))), ""]
    graph = _load("graph_e2e")
    if graph:
        lines += [
            "Produced by `python benchmarks/graph_e2e.py --contexts 4096 --roles 15 --max-tokens 32 --repetitions 2`.",
            "",
        ]
        lines += [*graph_section(graph), ""]
    if sweep:
        lines += [
            "Produced by `python benchmarks/perplexity_sweep.py --documents 5 --contexts 600 2048 4096 7168`.",
            "",
        ]
        lines += [*perplexity_section(sweep), ""]
    out = ROOT / "docs" / "RESULTS.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
