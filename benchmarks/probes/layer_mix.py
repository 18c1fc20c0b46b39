"""Probe: do the moves `layer_sensitivity.py` chose add up? Mixed-precision pools measured all at once.

`layer_sensitivity.py` measured each single-layer move on 3 texts and chose, assuming the moves add up, which
layers get 4-bit keys and which 2-bit values at about 5x. This measures those configs with the frontier's
protocol (:func:`~benchmarks.studies.ablation.run_ablation_suite`: one prefill per text, every rotation seed,
intervals over texts), on texts the choice was made on and on texts it never saw (``--first-document 5``):

    python benchmarks/probes/layer_mix.py --documents 5 --seeds 3 [--first-document 5]

On another model, give it the JSON `layer_sensitivity.py` wrote and the base it measured; it then measures the
base, the ``max`` preset and the moves chosen from that JSON:

    python benchmarks/probes/layer_mix.py --model M.gguf --sensitivity s.json --base ctq4/ctq2 --documents 3 --seeds 2

Measured 2026-12-03 on this project's 2-core machine (bf16, 2,048 tokens, one torch thread beside other runs).
SmolLM2-135M-Instruct, 5 texts x 3 seeds, PPL delta mean [95% CI over texts]:

  config                                                 x vs fp16  texts 0-4 (3 chose)   texts 5-9 (unseen)
  max (ctq4 pre-RoPE keys, ctq3 values)                    4.36x   +0.93% [+0.55, +1.30]  +1.62% [-0.98, +4.22]
  keys ctq3 pre-RoPE, values ctq3                          5.05x   +2.35% [+1.28, +3.42]  +5.58% [-5.76, +16.91]
  greedy: keys+ 8,18,20,23,26,28; values- 0,5,9,25,29      5.02x   +1.48% [+1.04, +1.92]  +2.49% [-1.07, +6.05]
  two: keys+ 18,20; values- 5,29                           5.05x   +1.97% [+1.22, +2.73]  +2.96% [-1.16, +7.08]
  keys+ 18,20 only                                         5.00x   +1.92% [+1.24, +2.60]  +2.70% [-1.47, +6.86]
  balanced 8                                               5.05x   +1.65% [+1.07, +2.23]  +2.65% [-0.77, +6.07]
  balanced 12                                              5.05x   +1.55% [+0.91, +2.19]  +2.52% [-0.74, +5.78]
  balanced 16                                              5.05x   +1.84% [+1.26, +2.42]  +2.58% [-0.56, +5.72]

Gemma-3-270M (``--sensitivity`` from 3 texts, ``--base ctq4/ctq2``), 3 texts x 2 seeds:

  config                                                 x vs fp16  texts 0-2 (chose)     texts 3-5 (unseen)
  max                                                      4.48x   +1.48% [-0.08, +3.03]  +2.07% [-3.88, +8.02]
  ctq4/ctq2                                                5.20x   +2.42% [+1.08, +3.76]  +4.67% [-5.54, +14.87]
  chosen: 3-bit keys on 0,2,4,7,10,12,13,16;               5.02x   +1.43% [+0.22, +2.63]  +3.13% [-3.38, +9.64]
          3-bit values on 0,2,3,7-12,14,16,17

- At 5x, moving bits between layers beats every uniform ~5x config of the frontier on its texts, on both models,
  and the uniform base on unseen texts too (whose intervals are wide and overlap); on Gemma it matches ``max``'s
  mean at 12% fewer bytes. None is within +1%.
- The single-layer moves predicted +0.24% (SmolLM2) and -0.59% (Gemma): they do not add up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layer_sensitivity import BASES, choose  # this folder is the script's first import path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` is not installed

from benchmarks.studies.ablation import run_ablation_suite
from polykv_agents import load_model
from polykv_agents.bench.configs import ctq
from polykv_agents.bench.sweep import pct_interval
from polykv_agents.config import CompressionConfig, LayerCodecs
from polykv_agents.eval.corpus import pydoc_documents


def mixed(keys_up: tuple[int, ...], values_down: tuple[int, ...]) -> CompressionConfig:
    """Centered TurboQuant at 3 bits (keys before RoPE), with 4-bit keys and 2-bit values on the listed layers."""
    layers = [LayerCodecs(layers=keys_up, keys=ctq(4, before_rope=True))] if keys_up else []
    layers += [LayerCodecs(layers=values_down, values=ctq(2))] if values_down else []
    return CompressionConfig(keys=ctq(3, before_rope=True), values=ctq(3), layers=layers)


# SmolLM2-135M's layers ordered by the single-layer moves of layer_sensitivity.py (3 texts, 2K, seed 0): keys at
# 4 bits from most to least gain, values at 2 bits from least to most loss.
KEYS_BY_GAIN = (18, 20, 8, 23, 28, 26, 29, 17, 9, 14, 27, 11, 25, 24, 21, 4, 15, 2, 22, 16, 10, 0, 1, 19, 3, 13, 5, 12)
VALUES_BY_LOSS = (5, 29, 9, 25, 0, 14, 26, 21, 22, 27, 13, 24, 2, 4, 11, 16, 20, 19, 12, 23, 28, 10, 8, 18, 17, 6, 7)

CANDIDATES = {
    "max (ctq4 pre-RoPE keys, ctq3 values)": CompressionConfig.preset("max"),
    "keys ctq3 pre-RoPE, values ctq3": mixed((), ()),
    "greedy: keys+ 8,18,20,23,26,28; values- 0,5,9,25,29": mixed((8, 18, 20, 23, 26, 28), (0, 5, 9, 25, 29)),
    "two: keys+ 18,20; values- 5,29": mixed((18, 20), (5, 29)),
    "keys+ 18,20 only": mixed((18, 20), ()),
    **{
        f"balanced {k}: keys+ best {k}, values- best {k}": mixed(KEYS_BY_GAIN[:k], VALUES_BY_LOSS[:k])
        for k in (8, 12, 16)
    },
}


def chosen(sensitivity: Path, base: str, target_ratio: float) -> dict[str, CompressionConfig]:
    """The base, ``max`` and the moves :func:`choose` takes from ``sensitivity`` (one config)."""
    config, move_keys, move_values = BASES[base]
    adding, saving, predicted, ratio = choose(json.loads(sensitivity.read_text()), target_ratio)
    kinds = {
        kind: tuple(sorted(int(move.split()[-1]) for move in adding + saving if move.startswith(kind)))
        for kind in ("keys", "values")
    }
    layers = [LayerCodecs(layers=kinds["keys"], keys=move_keys)] if kinds["keys"] else []
    layers += [LayerCodecs(layers=kinds["values"], values=move_values)] if kinds["values"] else []
    name = f"chosen (predicted {predicted:+.2f}% at {ratio:.2f}x): keys {kinds['keys']}; values {kinds['values']}"
    return {
        "max": CompressionConfig.preset("max"),
        base: config,
        name: CompressionConfig(keys=config.keys, values=config.values, layers=layers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=5)
    parser.add_argument("--first-document", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--model", default=None)
    parser.add_argument("--sensitivity", type=Path, default=None)
    parser.add_argument("--base", choices=list(BASES), default="ctq3/ctq3")
    parser.add_argument("--target-ratio", type=float, default=5.0)
    args = parser.parse_args()
    candidates = CANDIDATES if args.sensitivity is None else chosen(args.sensitivity, args.base, args.target_ratio)
    model, tokenizer = load_model(args.model)
    texts = pydoc_documents(args.first_document + args.documents)[args.first_document :]
    result = run_ablation_suite(
        model, tokenizer, texts, contexts=[args.context], seeds=list(range(args.seeds)),
        factors={name: ("layers", config) for name, config in candidates.items()},
    )  # fmt: skip
    info = result.info
    print(f"{info.model} ({info.dtype}), {args.context} tokens, texts {args.first_document}.. x {args.seeds} seeds")
    for row in result.rows:
        print(
            f"  {row['config']:55s} {row['config_label']} {row['compression_ratio_vs_fp16']:.2f}x  {pct_interval(row)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
