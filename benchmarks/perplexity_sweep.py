"""Perplexity delta of pooled vs full-precision caches, over documents, context lengths and configs.

Each (document, context length) is prefilled once; every config is compressed from that same
cache and scored on the same continuation (see polykv_agents.eval.perplexity).

    python benchmarks/perplexity_sweep.py --documents 5 --contexts 600 2048 4096 7168 \
        --out benchmarks/results/perplexity_sweep.json

Writes the raw rows as JSON and prints a Markdown table of mean / min / max delta per
(context, config), with the pool size and measured compression against fp16.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from polykv_agents import CodecConfig, CompressionConfig, load_model
from polykv_agents.eval import perplexity_deltas, pydoc_documents

CONFIGS = {
    "paper (K int8/tensor, V tq3)": CompressionConfig.paper(),
    "K int8/channel, V tq3 (default)": CompressionConfig(),
    "K int8/token, V tq3": CompressionConfig(keys=CodecConfig(method="int", bits=8, granularity="token")),
    "K int8/channel, V tq4": CompressionConfig(values=CodecConfig(method="turboquant", bits=4)),
    "K int4/channel, V tq3": CompressionConfig(keys=CodecConfig(method="int", bits=4, granularity="channel")),
    "K int4/token, V tq3": CompressionConfig(keys=CodecConfig(method="int", bits=4, granularity="token")),
    "K tq4, V tq3": CompressionConfig(keys=CodecConfig(method="turboquant", bits=4)),
    "K int8/channel, V tq3 no signs": CompressionConfig(
        values=CodecConfig(method="turboquant", bits=3, random_signs=False)
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=5)
    parser.add_argument("--contexts", type=int, nargs="+", default=[600, 2048, 4096, 7168])
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), help="names from CONFIGS")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/perplexity_sweep.json"))
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    configs = {name: CONFIGS[name] for name in args.configs}
    documents = pydoc_documents(args.documents)
    rows = []
    started = time.perf_counter()
    for context in args.contexts:
        for doc_idx, text in enumerate(documents):
            results = perplexity_deltas(
                model,
                tokenizer,
                text,
                context_tokens=context,
                continuation_tokens=args.continuation,
                configs=list(configs.values()),
            )
            for name, result in zip(configs, results, strict=True):
                rows.append({"document": doc_idx, "context": context, "config_name": name, **result.model_dump()})
                print(f"ctx={context} doc={doc_idx} {name}: delta={result.delta_pct:+.3f}%", flush=True)

    meta = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "model": rows[0]["model_name"],
        "dtype": rows[0]["dtype"],
        "documents": args.documents,
        "corpus": "pydoc_data.topics (CPython), disjoint ~40k-character slices",
        "continuation_tokens": args.continuation,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    print(f"\n{meta}\n")
    print("| context | config | mean delta % | min | max | pool MiB | x vs fp16 |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        for name in configs:
            sel = [r for r in rows if r["context"] == context and r["config_name"] == name]
            deltas = [r["delta_pct"] for r in sel]
            print(
                f"| {context} | {name} | {statistics.mean(deltas):+.3f} | {min(deltas):+.3f} | {max(deltas):+.3f} "
                f"| {sel[0]['pool_nbytes'] / 2**20:.2f} | {sel[0]['compression_ratio']:.2f} |"
            )


if __name__ == "__main__":
    main()
