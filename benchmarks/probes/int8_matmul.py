"""Probe: one decode step's matrix products for 1 to 32 rows, in each weight format the CPU offers, side by side.

For every distinct linear shape of the embedded SmolLM2 (its own weights: layer 0's projections and the output
head), the median microseconds of:

- ``bf16``: ``F.linear`` over the bfloat16 weights (oneDNN);
- ``int8 weight-only``: ``torch._weight_int8pack_mm``, int8 weights with one scale per output channel and
  bfloat16 activations (what ``weights="int8"`` runs today);
- ``int8 x int8``: ``torch._int_mm`` over int8 weights and activations quantized per row on the fly (absmax),
  with the quantization and the rescale as PyTorch operators, and ``torch._int_mm`` alone (the bound a fused
  quantization would approach).

Rows are the decode step's batch (agents). A step's sum over the model weights each shape by its count
(7 per layer x layers, the head once). Activations are random normal: this probe is about time, not accuracy (the
max abs difference from the float32 product is printed as a sanity check only). Writes ``--out`` (JSON):

    python -m benchmarks.probes.int8_matmul --out benchmarks/results/issue42/int8_matmul.json

The committed JSON says which commit and machine produced it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from polykv_agents.bench.stats import median_call_seconds


def _median_us(run: Callable[[], object], reps: int) -> float:
    return median_call_seconds(run, reps, warmups=max(3, reps // 10)) * 1e6


def _int8_per_row(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix [R, C]`` as int8 codes and one float32 scale per row (absmax / 127)."""
    scale = matrix.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    return (matrix.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def measure(weight: torch.Tensor, rows: int, reps: int) -> dict[str, float]:
    """Median microseconds of each format's product of ``rows`` random rows with ``weight [N, K]`` (bfloat16)."""
    codes, scale = _int8_per_row(weight)
    codes_t = codes.t().contiguous()  # [K, N]: torch._int_mm's right operand
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, weight.shape[1], generator=gen).bfloat16()

    def int8_x_int8() -> torch.Tensor:
        x_codes, x_scale = _int8_per_row(x)
        return (torch._int_mm(x_codes, codes_t).float() * x_scale * scale.t()).bfloat16()

    x_codes, _ = _int8_per_row(x)
    exact = torch.nn.functional.linear(x.float(), weight.float())
    return {
        "bf16": _median_us(lambda: torch.nn.functional.linear(x, weight), reps),
        "int8 weight-only": _median_us(lambda: torch._weight_int8pack_mm(x, codes, scale[:, 0].bfloat16()), reps),
        "int8 x int8, quantized in PyTorch": _median_us(int8_x_int8, reps),
        "int8 x int8, product alone": _median_us(lambda: torch._int_mm(x_codes, codes_t), reps),
        "int8 x int8 max abs difference": (int8_x_int8().float() - exact).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 15, 16, 32])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from polykv_agents.bench.provenance import Provenance
    from polykv_agents.model.compute_thread import run_on_compute_thread
    from polykv_agents.model.loading import load_model_uncached

    model, _ = load_model_uncached(None, torch.bfloat16, "cpu")
    layer = model.model.layers[0]
    linears = {
        "q_proj, o_proj": (layer.self_attn.q_proj, 2),
        "k_proj, v_proj": (layer.self_attn.k_proj, 2),
        "gate_proj, up_proj": (layer.mlp.gate_proj, 2),
        "down_proj": (layer.mlp.down_proj, 1),
    }
    counts = {name: count * model.config.num_hidden_layers for name, (_, count) in linears.items()}
    weights = {name: module.weight.detach() for name, (module, _) in linears.items()}
    weights["lm_head"], counts["lm_head"] = model.lm_head.weight.detach(), 1
    result = {
        "probe": "int8_matmul",
        "provenance": Provenance.of_this_process().model_dump(mode="json"),
        "settings": {"model": "SmolLM2-135M-Instruct", "reps": args.reps, "threads": torch.get_num_threads()},
        "shapes": {
            name: {"out_features": w.shape[0], "in_features": w.shape[1], "per_step": counts[name]}
            for name, w in weights.items()
        },
        "rows": {},
    }
    for rows in args.rows:
        # On the compute thread, which loaded the model: a second thread's OpenMP team would slow every product.
        per_shape = {name: run_on_compute_thread(measure, weight, rows, args.reps) for name, weight in weights.items()}
        formats = [key for key in next(iter(per_shape.values())) if not key.endswith("difference")]
        step_ms = {key: sum(per_shape[name][key] * counts[name] for name in weights) / 1e3 for key in formats}
        result["rows"][str(rows)] = {"per_shape_us": per_shape, "step_ms": step_ms}
        print(rows, "rows, one step's products (ms):", {k: round(v, 2) for k, v in step_ms.items()}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
