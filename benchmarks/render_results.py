"""Render docs/RESULTS.md from what the benchmarks wrote to benchmarks/results/.

    python benchmarks/render_results.py

For each suite that has run (``polykv-agents bench memory|quality|speed|ablation|peer``), its Markdown
and plots are written again from its JSON and included; then the multi-agent runtime (``bench
agents``) and end-to-end graph results. Writes docs/RESULTS.md and the suites' .md and .png files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from polykv_agents.bench.output import SuiteResult
from polykv_agents.bench.writers import WRITERS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


SUITES = {
    "memory": "polykv-agents bench memory",
    "quality": "polykv-agents bench quality",
    "speed": "polykv-agents bench speed",
    "ablation": "polykv-agents bench ablation",
    "peer": "polykv-agents bench peer --peer-python PEER_VENV/bin/python",
}


def suite_section(name: str, command: str) -> list[str]:
    """A suite's Markdown and plots, written again from its JSON (so a change of presentation needs no
    new measurement), its heading one level up and its images relative to docs/."""
    WRITERS[name](SuiteResult.load(RESULTS / f"{name}.json"), RESULTS)
    text = (RESULTS / f"{name}.md").read_text()
    text = re.sub(r"\]\(([\w.-]+\.png)\)", r"](../benchmarks/results/\1)", text)
    heading, body = text.replace("### ", "## ", 1).split("\n", 1)
    return [heading, "", f"Produced by `{command}`.", body]


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
    for name, command in SUITES.items():
        if (RESULTS / f"{name}.json").exists():
            lines += [*suite_section(name, command), ""]
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
    out = ROOT / "docs" / "RESULTS.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
