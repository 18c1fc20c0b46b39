"""Probe: which part of centered TurboQuant carries the new ``max`` preset's gain, at 4-bit keys.

``bench frontier`` measured centered TurboQuant keys before RoPE (4 bits) with centered values (3 bits) closer to
full precision than plain 4-bit TurboQuant keys; it did not separate the parts. This probe measures, with the
frontier's protocol (:func:`~benchmarks.studies.ablation.run_ablation_suite`: one prefill per text, every
rotation seed, intervals over texts), the new ``max`` against the same keys compressed after RoPE, and against
plain 3-bit TurboQuant values behind the same keys:

    python benchmarks/probes/max_candidates.py --documents 5 --seeds 3 [--model path/to/model.gguf]

It prints one line per config: ratio vs fp16 and the perplexity delta's mean [95% CI].

Measured 2026-12-03 on this project's 2-core machine, SmolLM2-135M-Instruct in bf16, 2,048 tokens,
``--documents 5 --seeds 3`` (one torch thread, beside a test run):

  max: keys ctq4 before RoPE, values ctq3    4.36x  +0.93% [+0.55, +1.30]
  keys ctq4 after RoPE, values ctq3          4.37x  +1.12% [+0.66, +1.58]
  keys ctq4 before RoPE, values tq3          4.31x  +0.92% [+0.66, +1.19]
  keys tq4, values tq3 (max of 0.1)          4.27x  +1.34% [+0.92, +1.76]

- Of the 0.41 points between the old and the new ``max``, compressing keys before RoPE accounts for about 0.2
  (after RoPE: +1.12%) and the sinks, mean and 8-bit norms of the keys for the rest; the intervals overlap, so
  neither part is established alone.
- Centering the values changes nothing measurable here (+0.93% against +0.92%) and its 8-bit norms make the pool
  smaller (4.36x against 4.31x), so the preset keeps centered values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` is not installed

from benchmarks.studies.ablation import run_ablation_suite
from polykv_agents import load_model
from polykv_agents.bench.configs import ctq
from polykv_agents.bench.sweep import pct_interval
from polykv_agents.config import CodecConfig, CompressionConfig
from polykv_agents.eval.corpus import pydoc_documents

CANDIDATES = {
    "max: keys ctq4 before RoPE, values ctq3": CompressionConfig.preset("max"),
    "keys ctq4 after RoPE, values ctq3": CompressionConfig(keys=ctq(4), values=ctq(3)),
    "keys ctq4 before RoPE, values tq3": CompressionConfig(
        keys=ctq(4, before_rope=True), values=CodecConfig(method="turboquant", bits=3)
    ),
    "keys tq4, values tq3 (max of 0.1)": CompressionConfig(
        keys=CodecConfig(method="turboquant", bits=4), values=CodecConfig(method="turboquant", bits=3)
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    result = run_ablation_suite(
        model, tokenizer, pydoc_documents(args.documents), contexts=[args.context],
        seeds=list(range(args.seeds)), factors={name: ("max", config) for name, config in CANDIDATES.items()},
    )  # fmt: skip
    info = result.info
    print(f"{info.model} ({info.dtype}), {args.context} tokens, {args.documents} texts x {args.seeds} seeds")
    for row in result.rows:
        print(f"  {row['config']:42s} {row['compression_ratio_vs_fp16']:.2f}x  {pct_interval(row)}")


if __name__ == "__main__":
    main()
