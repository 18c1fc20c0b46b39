"""Probe: which layers pay for a bit, for mixed precision by layer (``CompressionConfig.layers``).

Starts from a base config (default: centered TurboQuant keys at 3 bits before RoPE and values at 3 bits, 5.05x on
SmolLM2 at 2K) and measures, one layer at a time, the perplexity change of each single-layer move: that layer's
keys at 4 bits (``keys+``: costs bytes), and that layer's values at 2 bits (``values-``: saves bytes). The runs of
one (text, seed) share every other layer's codes, so a move's difference from the base isolates that layer.

Then, assuming the moves add up, it chooses the moves that maximise the perplexity gained for the bytes allowed
(``--target-ratio`` against fp16): every ``values-`` move whose loss is smallest per byte saved pays for the
``keys+`` moves whose gain is largest per byte spent. It prints the config to verify with the frontier's protocol
(``bench frontier``), which measures all the moves together:

    python benchmarks/probes/layer_sensitivity.py --documents 3 --seeds 1 --out sensitivity.json [--model ...]

Measured 2026-12-03 on this project's 2-core machine, SmolLM2-135M-Instruct in bf16, 2,048 tokens, 3 texts, seed 0
(one torch thread, beside other runs); base +2.37%:

- Two layers' keys stand out, the same in all three texts: 4-bit keys on layer 18 take -1.03/-0.95/-1.03 points off
  the perplexity delta, on layer 20 -0.39/-0.38/-0.47.
- Most other single-layer moves are within a few tenths of a point either way, and some 4-bit keys make it worse
  in every text (layer 6: +0.41/+0.37/+0.48).
- The moves do not add up: the 30 key moves sum to +2.06 points, but all layers at 4-bit keys (the ``max``
  preset) measure 1.4 points better than the base. The choice at 5x (keys on 8, 18, 20, 23, 26, 28; values on 0,
  5, 9, 25, 29) was predicted at +0.24% and measured at +1.48% (``layer_mix.py``).

Gemma-3-270M (``--base ctq4/ctq2 --model gemma-3-270m-q4_k_m.gguf``, same texts and seed; base +2.05%): 3-bit keys
cost most on layers 5 and 11 (+1.72 and +1.75 points) and least on 13 (-0.54); 3-bit values help most on 9 (-0.33).
The choice at 5x was predicted at -0.59% and measured at +1.43% (``layer_mix.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from polykv_agents import load_model
from polykv_agents.bench.configs import ctq
from polykv_agents.config import CompressionConfig, LayerCodecs
from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.eval.perplexity import perplexity_deltas

BASES = {  # base -> (its config, the key codec a move puts on one layer, the value codec a move puts there)
    "ctq3/ctq3": (
        CompressionConfig(keys=ctq(3, before_rope=True), values=ctq(3)),
        ctq(4, before_rope=True),
        ctq(2),
    ),
    "ctq4/ctq2": (
        CompressionConfig(keys=ctq(4, before_rope=True), values=ctq(2)),
        ctq(3, before_rope=True),
        ctq(3),
    ),
}


def moves(base: str, num_layers: int) -> dict[str, CompressionConfig]:
    """``keys L`` and ``values L`` for every layer: the move's codec on that layer, the base's elsewhere."""
    config, keys, values = BASES[base]

    def one_layer(**codecs) -> CompressionConfig:
        return CompressionConfig(
            keys=config.keys, values=config.values, layers=[LayerCodecs(layers=(layer,), **codecs)]
        )

    named = {}
    for layer in range(num_layers):
        named[f"keys {layer}"] = one_layer(keys=keys)
        named[f"values {layer}"] = one_layer(values=values)
    return named


def measure(model, tokenizer, texts, seeds, context: int, continuation: int, base: str) -> dict:
    num_layers = model.config.num_hidden_layers
    named = {"base": BASES[base][0], **moves(base, num_layers)}
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in named}  # (delta_pct, pool bytes)
    for index, text in enumerate(texts):
        for seed in seeds:
            configs = [config.with_seed(seed) for config in named.values()]
            results = perplexity_deltas(
                model, tokenizer, text, context_tokens=context, continuation_tokens=continuation, configs=configs
            )
            for name, result in zip(named, results, strict=True):
                samples[name].append((result.delta_pct, result.pool_nbytes))
            print(f"text {index} seed {seed}: base {samples['base'][-1][0]:+.2f}%", flush=True)
    reference = samples["base"]
    rows = []
    for name, values in samples.items():
        if name == "base":
            continue
        differences = [v[0] - b[0] for v, b in zip(values, reference, strict=True)]
        rows.append({
            "move": name,
            "delta_change_pct": statistics.fmean(differences),
            "per_sample": differences,
            "bytes_change": statistics.fmean(v[1] - b[1] for v, b in zip(values, reference, strict=True)),
        })  # fmt: skip
    return {
        "base": named["base"].label(),
        "move_codecs": {"keys": BASES[base][1].label(), "values": BASES[base][2].label()},
        "base_delta_pct": statistics.fmean(b[0] for b in reference),
        "base_nbytes": statistics.fmean(b[1] for b in reference),
        "fp16_nbytes": results[0].fp16_nbytes,
        "rows": rows,
    }


def choose(measured: dict, target_ratio: float) -> tuple[list[int], list[int], float, float]:
    """``(moves that add bytes, moves that save bytes, predicted delta, predicted ratio)`` within ``target_ratio``."""
    budget = measured["fp16_nbytes"] / target_ratio - measured["base_nbytes"]  # bytes the moves may add (or must save)
    ups = sorted(
        (r for r in measured["rows"] if r["bytes_change"] > 0 and r["delta_change_pct"] < 0),
        key=lambda r: r["delta_change_pct"] / r["bytes_change"],
    )  # most gain per byte first
    downs = sorted(
        (r for r in measured["rows"] if r["bytes_change"] < 0),
        key=lambda r: r["delta_change_pct"] / -r["bytes_change"],
    )  # least loss per byte saved first
    best = ([], [], measured["base_delta_pct"], measured["base_nbytes"])
    for n_down in range(len(downs) + 1):
        spare = budget - sum(r["bytes_change"] for r in downs[:n_down])
        chosen_ups, spent = [], 0.0
        for row in ups:
            if spent + row["bytes_change"] <= spare:
                chosen_ups.append(row)
                spent += row["bytes_change"]
        if spare < 0:
            continue
        delta = measured["base_delta_pct"] + sum(r["delta_change_pct"] for r in chosen_ups + downs[:n_down])
        nbytes = measured["base_nbytes"] + spent + sum(r["bytes_change"] for r in downs[:n_down])
        if delta < best[2]:
            best = (chosen_ups, downs[:n_down], delta, nbytes)
    return (
        sorted(r["move"] for r in best[0]),
        sorted(r["move"] for r in best[1]),
        best[2],
        measured["fp16_nbytes"] / best[3],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--target-ratio", type=float, default=5.0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--base", choices=list(BASES), default="ctq3/ctq3")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    measured = measure(
        model, tokenizer, pydoc_documents(args.documents), range(args.seeds), args.context, args.continuation, args.base
    )
    args.out.write_text(json.dumps(measured, indent=1))
    for row in sorted(measured["rows"], key=lambda r: r["delta_change_pct"]):
        print(f"  {row['move']:12s} {row['delta_change_pct']:+.3f} points  {row['bytes_change']:+.0f} bytes")
    ups, downs, delta, ratio = choose(measured, args.target_ratio)
    print(f"moves that add bytes: {ups}; moves that save bytes: {downs}")
    print(f"predicted: {delta:+.2f}% at {ratio:.2f}x (base {measured['base_delta_pct']:+.2f}%)")


if __name__ == "__main__":
    main()
