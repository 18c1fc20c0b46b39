"""Probe: does a 1-bit QJL sketch of the residual make better keys than one more Lloyd–Max bit?

TurboQuant's inner-product variant (Zandieh et al. 2025, "TurboQuant_prod") spends its last bit per coordinate
on QJL: the key is MSE-quantised at ``b - 1`` bits, and the residual ``r = k - k_mse`` is kept as
``sign(S r)`` (``S`` a seeded ``[d, d]`` Gaussian matrix) plus ``||r||``. Decoding

    k_prod = k_mse + sqrt(pi / 2) / d * ||r|| * S.T @ sign(S r)

makes ``q . k_prod`` an unbiased estimate of ``q . k`` for every query, where ``k_mse`` alone shrinks it. The
price is variance. This probe puts both on keys at the same bits, values at 3-bit TurboQuant as in the frontier:

- ``keys tq4``: 4-bit TurboQuant-MSE (the frontier's ``keys tq4, values tq3``);
- ``keys tq3 + QJL``: 3-bit TurboQuant-MSE and the residual's 1-bit sketch (4 bits, one more fp16 norm);
- ``keys tq3``: the same without the sketch, to show what the sketch's bit buys;
- ``keys tq2 + QJL`` against ``keys tq3``: the same question one bit lower.

Per text, one prefill; each variant's keys and values are encoded and decoded from that cache, and the
continuation's perplexity is compared with the full-precision cache's (the quality protocol of
:mod:`polykv_agents.eval.perplexity`). Sizes are the ``nbytes`` of the tensors each variant stores (codes, signs
and norms), against the fp16 cache. The first row also runs through ``SharedKVPool`` to show the probe's path
measures what the library's pool measures.

    python benchmarks/probes/qjl_residual.py --documents 5 [--context 2048] [--model path/to/model.gguf]
    python benchmarks/probes/qjl_residual.py --random

Measured 2026-12-04 on this project's 2-core machine, bf16, 2,048 tokens, 5 texts, seed 0, one torch thread
(beside two task runs); ratio vs fp16 from the stored tensors, PPL delta mean [95% CI] over the texts:

  SmolLM2-135M-Instruct                        Gemma-3-270M (gemma-3-270m-q4_k_m.gguf)
  keys tq4, values tq3        4.27x  +1.23% [+0.68, +1.78]    4.49x   +2.58% [-0.17, +5.33]
  keys tq3 + QJL, values tq3  4.13x  +4.59% [+3.42, +5.77]    4.45x  +44.12% [+30.35, +57.89]
  keys tq3, values tq3        4.92x  +2.84% [-0.05, +5.73]    5.22x  +22.50% [+15.17, +29.82]
  keys tq2 + QJL, values tq3  4.74x +29.61% [+17.85, +41.36]  5.17x +214.87% [+146.13, +283.61]

The library's pool gave the first row to the digit on both models (+1.23%, +2.58%), so the probe's path is the
pool's. The sketch's bit makes keys worse than no fourth bit at all: on all 5 texts of Gemma and on 4 of 5 of
SmolLM2; against a fourth codebook bit it loses on every text of both. Attention turns logit errors into
probabilities through a softmax, where the sketch's variance costs more than its unbiasedness saves.
``--random`` shows both on Gaussian vectors (64 keys of 64 dims, one query, 300 seeds of rotation and sketch):
the sketch cut the mean bias of ``q . k`` from 0.19 to 0.07 and raised its error per estimate from 1.42 to 1.76
RMS; a fourth Lloyd–Max bit gives 0.05 and 0.74. The frontier therefore spends every key bit on the codebook.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from polykv_agents import load_model
from polykv_agents.bench.stats import mean_interval
from polykv_agents.codecs.bitpack import pack_codes
from polykv_agents.codecs.turboquant import TurboQuantCodec
from polykv_agents.config import CodecConfig, CompressionConfig
from polykv_agents.eval.corpus import pydoc_documents
from polykv_agents.eval.perplexity import continuation_nll, prefix_and_continuation
from polykv_agents.model.compat import cache_from_key_values, layer_key_values
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool

VARIANTS = {  # name -> (key MSE bits, QJL sketch of the key residual)
    "keys tq4, values tq3": (4, False),
    "keys tq3 + QJL, values tq3": (3, True),
    "keys tq3, values tq3": (3, False),
    "keys tq2 + QJL, values tq3": (2, True),
}
SEED = 0


def qjl_matrix(head_dim: int, seed: int) -> torch.Tensor:
    """The sketch's seeded Gaussian ``S [d, d]`` (float32)."""
    generator = torch.Generator().manual_seed(10_007 + seed)
    return torch.randn(head_dim, head_dim, generator=generator)


def roundtrip(x: torch.Tensor, bits: int, sketch: bool, seed: int) -> tuple[torch.Tensor, int]:
    """``x [b, h, t, d]`` encoded and decoded: TurboQuant-MSE at ``bits`` (rotation ``seed``), plus the residual's
    QJL sketch if ``sketch``. Returns the decoded tensor (``x``'s dtype) and the bytes the encoding stores."""
    codec = TurboQuantCodec(bits=bits, seed=seed)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded, torch.float32)  # [b, h, t, d]
    stored = sum(t.nbytes for t in encoded.tensors.values())
    if not sketch:
        return decoded.to(x.dtype), stored
    head_dim = x.shape[-1]
    residual = x.float() - decoded  # [b, h, t, d]
    residual_norm = residual.norm(dim=-1, keepdim=True).to(torch.float16)  # [b, h, t, 1], stored
    matrix = qjl_matrix(head_dim, seed)  # [d, d]
    signs = (residual @ matrix.T) >= 0  # [b, h, t, d]: sign(S r), one bit per coordinate
    packed = pack_codes(signs.to(torch.uint8), 1)
    stored += packed.nbytes + residual_norm.nbytes
    estimate = (signs.float() * 2 - 1) @ matrix  # [b, h, t, d]: S.T @ sign(S r), per vector
    decoded = decoded + math.sqrt(math.pi / 2) / head_dim * residual_norm.float() * estimate
    return decoded.to(x.dtype), stored


def random_vector_check(seeds: int = 300) -> None:
    """Bias and error of ``q . k`` over ``seeds`` rotations and sketches, for Gaussian keys and one query."""
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 64, 64)  # [b, h, t, d]
    query = torch.randn(64)
    exact = keys[0, 0] @ query  # [t]
    for name, bits, sketch in (("tq3", 3, False), ("tq3 + QJL", 3, True), ("tq4", 4, False)):
        estimates = torch.stack([roundtrip(keys, bits, sketch, seed)[0][0, 0] @ query for seed in range(seeds)])
        bias = (estimates.mean(0) - exact).abs().mean().item()
        rms = ((estimates - exact) ** 2).mean().sqrt().item()
        print(f"{name:10s} mean |bias| {bias:.2f}  RMS error {rms:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=5)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--model", default=None)
    parser.add_argument("--random", action="store_true", help="only the check on random vectors (no model)")
    args = parser.parse_args()
    if args.random:
        random_vector_check()
        return
    model, tokenizer = load_model(args.model)
    deltas: dict[str, list[float]] = {name: [] for name in VARIANTS}
    ratios: dict[str, float] = {}
    library: list[float] = []
    for text in pydoc_documents(args.documents):
        prefix, continuation = prefix_and_continuation(model, tokenizer, text, args.context, args.continuation)
        cache, _ = prefill_cache(model, prefix)
        key_values = layer_key_values(cache)
        fp16_bytes = sum(2 * (k.numel() + v.numel()) for k, v in key_values)
        full = math.exp(continuation_nll(model, cache_from_key_values(model, key_values), continuation, args.context))
        for name, (bits, sketch) in VARIANTS.items():
            layers, stored = [], 0
            for keys, values in key_values:
                keys_hat, key_bytes = roundtrip(keys, bits, sketch, SEED)
                values_hat, value_bytes = roundtrip(values, 3, False, SEED + 1)  # the pool's value seed
                layers.append((keys_hat, values_hat))
                stored += key_bytes + value_bytes
            pooled = math.exp(continuation_nll(model, cache_from_key_values(model, layers), continuation, args.context))
            deltas[name].append(100 * (pooled - full) / full)
            ratios[name] = fp16_bytes / stored
        reference = CompressionConfig(
            keys=CodecConfig(method="turboquant", bits=4), values=CodecConfig(method="turboquant", bits=3), seed=SEED
        )
        pool = SharedKVPool.from_cache(model, tokenizer, cache, prefix, config=reference)  # the same prefill
        pooled = math.exp(continuation_nll(model, pool.to_cache(model), continuation, args.context))
        library.append(100 * (pooled - full) / full)
        print(f"text {len(library)}: " + ", ".join(f"{n}: {d[-1]:+.2f}%" for n, d in deltas.items()), flush=True)
    for name, values in deltas.items():
        delta = mean_interval(values)
        print(f"{name:30s} {ratios[name]:.2f}x  {delta.mean:+.2f}% [{delta.low:+.2f}, {delta.high:+.2f}]")
    print(f"library pool, keys tq4, values tq3: {statistics.fmean(library):+.2f}% (the first row, through the pool)")


if __name__ == "__main__":
    main()
