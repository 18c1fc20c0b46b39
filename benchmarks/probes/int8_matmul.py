"""Probe: one decode step's matrix products for 1 to 32 rows in each int8 form the CPU offers, and what int8
activations would cost in perplexity.

**Time.** For the embedded SmolLM2 in bfloat16, every linear layer of the model in turn (its own weights, so they
come from memory as in a decode step, not from a core's cache), the median ms of one step's products in:

- ``bf16``: ``F.linear`` over the bfloat16 weights (oneDNN);
- ``int8 weight-only kernel``: ``torch._weight_int8pack_mm`` (int8 weights, one scale per output channel,
  bfloat16 activations), what ``weights="int8"`` ran up to ``KERNEL_MAX_ROWS`` rows before the tile kernel;
- ``int8 dequantized``: the weight widened to bfloat16, then ``F.linear`` (the path above that);
- ``int8 tiles``: the native kernel ``int8_linear`` (:mod:`polykv_agents.model.int8_tiles`), where built;
- ``int8 x int8``: ``torch._int_mm`` over int8 weights and activations quantized per row (absmax), alone and with
  the quantization and rescale as PyTorch operators.

**Perplexity** (``--documents``): the mean per-token NLL of ``--tokens``-token pydoc_data.topics documents,
teacher-forced in one forward pass, for the native model and for int8 weights computed by each path: the
dequantized product (the weight widened, then ``F.linear``), the tile kernel (16 rows per call, as in decode), and
int8 activations per row or per group of 32 input features (llama.cpp's Q8_0 block; emulated in float). Every int8
path reads its input embedding from the output layer's int8 codes, as ``weights="int8"`` does; one more row, the
tile kernel with the native (bf16) embedding put back, shows what that costs. The interval is over documents.

    python -m benchmarks.probes.int8_matmul --out benchmarks/results/issue42/int8_matmul.json

The committed JSON says which commit and machine produced it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from polykv_agents.bench.stats import mean_interval, median_call_seconds
from polykv_agents.model.int8_tiles import TILE_MAX_ROWS, pack, tile_matmul, tiles_available


def _per_row_int8(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix [R, C]`` as int8 codes and one float32 scale per row (absmax / 127)."""
    scale = (matrix.float().abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (matrix.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def _linears(model) -> list[nn.Module]:
    """Every linear layer of a decode step, in the order a step runs them (the output layer last)."""
    layers = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    return [*layers, model.lm_head]


def step_products(weights: list[torch.Tensor], rows: int, reps: int) -> dict[str, float]:
    """Median ms of one step's products of ``rows`` random rows with each of ``weights`` (``[N, K]`` bfloat16)."""
    codes, scales = zip(*(_per_row_int8(w) for w in weights), strict=True)
    gen = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, w.shape[1], generator=gen).bfloat16() for w in weights]
    x_codes = [_per_row_int8(x) for x in xs]
    codes_t = [c.t().contiguous() for c in codes]
    bf16_scales = [s[:, 0].bfloat16() for s in scales]

    def int8_x_int8() -> None:
        for x, c, s in zip(xs, codes_t, scales, strict=True):
            xc, xs_ = _per_row_int8(x)
            (torch._int_mm(xc, c).float() * xs_ * s.t()).bfloat16()

    formats: dict[str, Callable[[], object]] = {
        "bf16": lambda: [nn.functional.linear(x, w) for x, w in zip(xs, weights, strict=True)],
        "int8 weight-only kernel": lambda: [
            torch._weight_int8pack_mm(x, c, s) for x, c, s in zip(xs, codes, bf16_scales, strict=True)
        ],
        "int8 dequantized": lambda: [
            nn.functional.linear(x, c.bfloat16()) * s for x, c, s in zip(xs, codes, bf16_scales, strict=True)
        ],
        "int8 x int8, quantized in PyTorch": int8_x_int8,
        "int8 x int8, product alone": lambda: [
            torch._int_mm(xc, c) for (xc, _), c in zip(x_codes, codes_t, strict=True)
        ],
    }
    if tiles_available() and rows <= TILE_MAX_ROWS:
        packed = [pack(c) for c in codes]
        flat_scales = [s[:, 0].contiguous() for s in scales]
        formats["int8 tiles"] = lambda: [tile_matmul(x, p, s) for x, p, s in zip(xs, packed, flat_scales, strict=True)]
    return {name: median_call_seconds(run, reps, warmups=3) * 1e3 for name, run in formats.items()}


def _dequantized(layer, rows: torch.Tensor) -> torch.Tensor:
    """The weight widened to the activations' dtype, then an ordinary product: the path without the tile kernel."""
    return nn.functional.linear(rows, layer.codes().to(rows.dtype)) * layer.scales.to(rows.dtype)


def _in_row_blocks(layer, rows: torch.Tensor) -> torch.Tensor:
    """The tile kernel, 16 rows per call as in a decode step."""
    codes = pack(layer.codes())
    scales = layer.scales.float()
    return torch.cat([tile_matmul(block, codes, scales) for block in rows.split(TILE_MAX_ROWS)])


def _int8_activations(group: int | None) -> Callable:
    """An ``Int8Linear._matmul`` with int8 activations: one scale per row (``group=None``) or per ``group`` input
    features of a row, emulated in float (exact products of the codes, summed in float32)."""

    def matmul(layer, rows: torch.Tensor) -> torch.Tensor:
        x = rows.float()
        m, k = x.shape
        width = group or k
        padded = nn.functional.pad(x, (0, -k % width)).view(m, -1, width)
        codes, scale = _per_row_int8(padded.reshape(-1, width))
        dequantized = (codes.float() * scale).view(m, -1)[:, :k]
        return (dequantized @ layer.codes().float().t() * layer.scales.float()).to(rows.dtype)

    return matmul


def perplexities(documents: int, tokens: int) -> dict:
    """Per-document mean NLL of the native model and of int8 weights on each path (see the module's notes)."""
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.model.loading import load_model_uncached
    from polykv_agents.model.quantized_linear import Int8Linear
    from polykv_agents.model.weights import quantize_weights

    model, tokenizer = load_model_uncached(None, torch.bfloat16, "cpu")
    texts = pydoc_documents(documents, tokens * 8)
    ids = [tokenizer(text, return_tensors="pt").input_ids[:, :tokens] for text in texts]

    def nlls() -> list[float]:
        with torch.inference_mode():
            return [nn.functional.cross_entropy(model(doc).logits[0, :-1].float(), doc[0, 1:]).item() for doc in ids]

    per_path = {"native": nlls()}
    native_embedding = model.get_input_embeddings()
    quantize_weights(model, "int8")  # the input embedding too: it reads the tied output layer's int8 codes
    stored = Int8Linear._matmul
    paths = {"int8 weights, dequantized product": _dequantized, "int8 x int8 per row": _int8_activations(None)}
    paths["int8 x int8 per group of 32"] = _int8_activations(32)
    if tiles_available():
        paths["int8 weights, tile kernel"] = _in_row_blocks
    try:
        for name, matmul in paths.items():
            Int8Linear._matmul = matmul
            per_path[name] = nlls()
        if tiles_available():  # what the int8 embedding changes: the same weights with the native embedding back
            int8_embedding = model.get_input_embeddings()
            model.set_input_embeddings(native_embedding)
            per_path["int8 weights, tile kernel, native embedding"] = nlls()
            model.set_input_embeddings(int8_embedding)
    finally:
        Int8Linear._matmul = stored
    native = per_path["native"]
    summary = {}
    for name, values in per_path.items():
        change = mean_interval([100 * (math.exp(v - n) - 1) for v, n in zip(values, native, strict=True)])
        summary[name] = {
            "perplexity": math.exp(sum(values) / len(values)),
            "per_document_nll": values,
            "change_vs_native_pct": change.model_dump(),
        }
    return {"documents": documents, "tokens": tokens, "paths": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 15, 16, 32])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from polykv_agents.bench.provenance import Provenance
    from polykv_agents.model.compute_thread import run_on_compute_thread
    from polykv_agents.model.loading import load_model_uncached

    model, _ = load_model_uncached(None, torch.bfloat16, "cpu")
    weights = [linear.weight.detach() for linear in _linears(model)]
    result = {
        "probe": "int8_matmul",
        "provenance": Provenance.of_this_process().model_dump(mode="json"),
        "settings": {
            "model": "SmolLM2-135M-Instruct",
            "dtype": "bfloat16",
            "reps": args.reps,
            "threads": torch.get_num_threads(),
            "products_per_step": len(weights),
            "tiles_available": tiles_available(),
        },
        "step_ms": {},
    }
    for rows in args.rows:
        # On the compute thread, which loaded the model: a second thread's OpenMP team would slow every product.
        step_ms = run_on_compute_thread(step_products, weights, rows, args.reps)
        result["step_ms"][str(rows)] = step_ms
        print(rows, "rows, one step's products (ms):", {k: round(v, 1) for k, v in step_ms.items()}, flush=True)
    del model, weights
    if args.documents:
        result["perplexity"] = run_on_compute_thread(perplexities, args.documents, args.tokens)
        for name, row in result["perplexity"]["paths"].items():
            change = row["change_vs_native_pct"]
            print(
                f"{name}: perplexity {row['perplexity']:.3f}, {change['mean']:+.2f}% "
                f"[{change['low']:+.2f}, {change['high']:+.2f}] vs native",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
