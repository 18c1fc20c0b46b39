"""Pool sizes and build / decompress times on the embedded model, at given context lengths.

    python benchmarks/pool_build.py --contexts 2048 4096 --repetitions 3 \
        --out benchmarks/results/pool_build.json

For each context length: one warm-up, then ``--repetitions`` timed runs of
  prefill (chunked forward over the document), compress (pool from that cache),
  decompress (pool -> a DynamicCache in the model's dtype);
sizes are ``nbytes`` of the stored tensors and of the uncompressed cache. Medians are reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

from polykv_agents import CompressionConfig, SharedKVPool, load_model
from polykv_agents.eval import pydoc_documents
from polykv_agents.prefill import prefill_cache


def _timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pool_build.json"))
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    text = pydoc_documents(1, chars_per_document=60_000)[0]
    all_ids = tokenizer(text, return_tensors="pt").input_ids[0]
    configs = {"default": CompressionConfig(), "paper": CompressionConfig.paper()}
    rows = []
    for context in args.contexts:
        ids = all_ids[:context]
        for name, config in configs.items():
            timings: dict[str, list[float]] = {"prefill_s": [], "compress_s": [], "decompress_s": []}
            for repetition in range(args.repetitions + 1):  # the first run is the warm-up
                (cache, _), prefill_s = _timed(lambda ids=ids: prefill_cache(model, ids))
                pool, compress_s = _timed(
                    lambda cache=cache, ids=ids, config=config: SharedKVPool.from_cache(
                        model, tokenizer, cache, ids, config=config
                    )
                )
                del cache
                _, decompress_s = _timed(lambda pool=pool: pool.to_cache(model))
                if repetition:
                    for key, value in zip(timings, (prefill_s, compress_s, decompress_s), strict=True):
                        timings[key].append(value)
            medians = {key: statistics.median(values) for key, values in timings.items()}
            row = {
                "context": context,
                "config": name,
                "config_label": config.label(),
                "pool_nbytes": pool.nbytes,
                "fp16_nbytes": pool.fp16_nbytes,
                "model_dtype_nbytes": pool.model_dtype_nbytes,
                "compression_ratio_vs_fp16": pool.compression_ratio,
                "compression_ratio_vs_model_dtype": pool.model_dtype_nbytes / pool.nbytes,
                **{f"median_{k}": v for k, v in medians.items()},
                "compress_pct_of_prefill": 100 * medians["compress_s"] / medians["prefill_s"],
                "decompress_pct_of_prefill": 100 * medians["decompress_s"] / medians["prefill_s"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

    meta = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "model": pool.fingerprint.name,
        "dtype": pool.fingerprint.dtype,
        "repetitions": args.repetitions,
        "warmup_runs": 1,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "document": "pydoc_data.topics (CPython), first 60k characters",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
