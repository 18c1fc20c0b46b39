"""Probe: int8 weights in a float32 model, what ``dtype="auto"`` gives on a CPU without AVX-512 bf16 or AMX.

PyTorch's int8 weight-only kernel (``_weight_int8pack_mm``) is vectorised for bfloat16 and float16 rows only: with
float32 rows it runs a scalar loop. At eb30382 :class:`~polykv_agents.model.quantized_linear.Int8Linear` in an fp32
model rounded its rows to bfloat16 for it, up to ``KERNEL_MAX_ROWS`` rows, and returned float32; that was reverted
(a row's result then depended on its step's row count; docs/RUNTIME.md, "Which weights by default"). Since then, on a
CPU with AVX-512, ``Int8Linear`` in an fp32 model runs the native kernel's vector path
(:func:`~polykv_agents.model.int8_tiles.vector_matmul`: float32 rows, each output one chain over the inputs, so a row's
result does not depend on its step). The decode and perplexity figures measure whatever ``Int8Linear`` does at the
commit that runs this. In one process, on the embedded SmolLM2 in float32, this measures:

- **one decode step's products** (every linear layer of the model in turn, its own weights, so they come from memory
  as in a step), median ms for ``--rows``: the float32 weights (``F.linear``, oneDNN), the native kernel's vector
  path (where built), PyTorch's int8 kernel with float32 rows and with the rows in bfloat16 (what ``Int8Linear`` ran
  at eb30382; up to :data:`PYTORCH_KERNEL_MAX_ROWS` rows: with float32 rows its scalar loop takes seconds a step
  beyond); with ``--avx2``, also the vector path built for AVX2 only (what a CPU without AVX-512 runs: the same
  bits, 8 columns an instruction instead of 16);
- **decode tokens/s** of 1 and 15 agents over one ``--context``-token pool, native weights against int8, alternating
  (A B A B, each in a fresh engine, a warm-up run then ``--reps`` timed runs; 32 tokens per agent, EOS ignored);
- **perplexity** of ``--documents`` pydoc_data.topics documents of ``--tokens`` tokens, native against int8, fed 16
  tokens per forward over a cache (a decode step's row counts) and in one forward (a prefill's: where the native
  kernel does not run, the weight widened to float32); the interval is over documents;
- the weights' bytes (each storage once).

    python -m benchmarks.probes.fp32_int8 --out benchmarks/results/issue42/fp32_int8.json
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 python -m \
        benchmarks.probes.fp32_int8 --avx2 --products-only --out benchmarks/results/issue42/fp32_int8_avx2.json

It refuses to run where ``dtype="auto"`` is not float32 (a CPU with AVX-512 bf16 or AMX): there the model computes
in bfloat16 and ``benchmarks.probes.int8_matmul`` measures its paths. The committed JSON says which commit and
machine produced it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from benchmarks.probes.int8_matmul import _linears, _per_row_int8
from benchmarks.probes.rss_census import _weights_nbytes
from polykv_agents.bench.stats import mean_interval, median_call_seconds
from polykv_agents.kernels import build_for_instructions, native_kernel
from polykv_agents.model.int8_tiles import pack, vector_matmul, vectors_available

DECODE_ROWS = 16
"""Tokens per forward on the decode path: ``KERNEL_MAX_ROWS``, the most rows ``Int8Linear`` sends to PyTorch's kernel
(where the native kernel does not run)."""

INSTRUCTION_LIMITS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
"""Environment variables that hold PyTorch's, MKL's and oneDNN's kernels to fewer instructions (say AVX2, to time the
float32 weights as a CPU without AVX-512 runs them beside the AVX2 build); recorded with the result."""

PYTORCH_KERNEL_MAX_ROWS = 16
"""The most rows PyTorch's int8 kernel is timed at (its float32 rows take 1.2 s a step at 15 rows)."""


def step_products(weights: list[torch.Tensor], rows: int, reps: int, avx2=None) -> dict[str, float]:
    """Median ms of one step's products of ``rows`` random rows with each of ``weights`` (``[N, K]`` float32);
    ``avx2``: the kernel built for AVX2 only, timed beside the usual build (``--avx2``)."""
    codes, scales = zip(*(_per_row_int8(w) for w in weights), strict=True)
    flat = [s[:, 0].contiguous() for s in scales]
    bf16_scales = [s.bfloat16() for s in flat]
    gen = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]
    formats = {"float32": lambda: [nn.functional.linear(x, w) for x, w in zip(xs, weights, strict=True)]}
    if vectors_available():
        packed = [pack(c) for c in codes]
        formats["native kernel, vector path"] = lambda: [
            vector_matmul(x, p, s) for x, p, s in zip(xs, packed, flat, strict=True)
        ]
    if avx2 is not None:
        formats["native kernel, vector path, AVX2 build"] = lambda: [
            avx2.int8_linear_float(x, p, s) for x, p, s in zip(xs, packed, flat, strict=True)
        ]
    if rows <= PYTORCH_KERNEL_MAX_ROWS:
        formats["int8 kernel, float32 rows"] = lambda: [
            torch._weight_int8pack_mm(x, c, s) for x, c, s in zip(xs, codes, flat, strict=True)
        ]
        formats["int8 kernel, bfloat16 rows"] = lambda: [
            torch._weight_int8pack_mm(x.bfloat16(), c, s).float()
            for x, c, s in zip(xs, codes, bf16_scales, strict=True)
        ]
    return {name: median_call_seconds(run, reps, warmups=2) * 1e3 for name, run in formats.items()}


def _nll(model, doc: torch.Tensor, block: int | None) -> float:
    """Mean next-token NLL of ``doc [1, T]``: in one forward (``block=None``) or ``block`` tokens per forward."""
    from polykv_agents.model.compat import forward_with_cache, new_full_cache

    if block is None:
        logits = model(doc).logits[0]
    else:
        cache = new_full_cache()
        parts = [
            forward_with_cache(model, doc[:, start : start + block], cache, start_position=start)[0]
            for start in range(0, doc.shape[1], block)
        ]
        logits = torch.cat(parts)
    return nn.functional.cross_entropy(logits[:-1].float(), doc[0, 1:]).item()


def perplexities(models: dict, documents: int, tokens: int) -> dict:
    """Per-document NLL for each weights setting and feeding (see the module's notes), and each one's change."""
    from polykv_agents.eval.corpus import pydoc_documents

    _, tokenizer = models["native"]
    texts = pydoc_documents(documents, tokens * 8)
    ids = [tokenizer(text, return_tensors="pt").input_ids[:, :tokens] for text in texts]
    per_path = {}
    with torch.inference_mode():
        for weights, (model, _) in models.items():
            per_path[f"{weights}, {DECODE_ROWS} tokens a forward"] = [_nll(model, doc, DECODE_ROWS) for doc in ids]
            per_path[f"{weights}, one forward"] = [_nll(model, doc, None) for doc in ids]
    summary = {}
    for name, values in per_path.items():
        native = per_path[f"native, {name.split(', ', 1)[1]}"]  # the same feeding
        change = mean_interval([100 * (math.exp(v - n) - 1) for v, n in zip(values, native, strict=True)])
        summary[name] = {"perplexity": math.exp(sum(values) / len(values)), "per_document_nll": values,
                         "change_vs_native_pct": change.model_dump()}  # fmt: skip
    return {"documents": documents, "tokens": tokens, "paths": summary}


def decode_rates(models: dict, context: int, agents: int, reps: int) -> dict[str, list[float]]:
    """Tokens/s of ``agents`` agents answering at once over one pool, per weights setting, alternating."""
    import pydoc_data.topics

    from polykv_agents import Engine, PooledAgent, SharedKVPool
    from polykv_agents.bench.agents import role_prompts, run_batched
    from polykv_agents.sampling.settings import GenerationSettings

    model, tokenizer = models["native"]
    ids = tokenizer("\n".join(pydoc_data.topics.topics.values())[:400_000], return_tensors="pt").input_ids[0]
    pool = SharedKVPool.prefill(model, tokenizer, tokenizer.decode(ids[:context], skip_special_tokens=True))
    settings = GenerationSettings(max_new_tokens=32, ignore_eos=True)
    roles = role_prompts(agents)
    samples: dict[str, list[float]] = {weights: [] for weights in models}
    for weights in [*models] * 2:
        model, tokenizer = models[weights]
        engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
        try:
            pooled = [PooledAgent(pool, model, tokenizer, system_prompt=r, engine=engine) for r, _ in roles]
            questions = [q for _, q in roles]
            run_batched(pooled, questions, settings)  # warm-up
            for _ in range(reps):
                tokens, seconds = run_batched(pooled, questions, settings)
                samples[weights].append(tokens / seconds)
        finally:
            engine.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 15, 16, 64, 512])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=2, help="timed decode runs per round (two rounds)")
    parser.add_argument("--product-reps", type=int, default=15)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--avx2", action="store_true", help="also time the kernel built for AVX2 only (products only)")
    parser.add_argument("--products-only", action="store_true", help="skip decode and perplexity")
    args = parser.parse_args()

    from polykv_agents.bench.provenance import Provenance
    from polykv_agents.model.compute_thread import run_on_compute_thread
    from polykv_agents.model.dtype import auto_dtype
    from polykv_agents.model.loading import load_model_uncached

    if auto_dtype("cpu") != torch.float32:
        parser.error("this CPU computes in bfloat16 (AVX-512 bf16 or AMX): use python -m benchmarks.probes.int8_matmul")
    models = {w: load_model_uncached(None, torch.float32, "cpu", weights=w) for w in ("native", "int8")}
    result = {
        "probe": "fp32_int8",
        "provenance": Provenance.of_this_process().model_dump(mode="json"),
        "settings": {
            "model": "SmolLM2-135M-Instruct",
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_vector_path": native_kernel("int8_linear").vector_instructions() if vectors_available() else "",
            "instruction_limits": {name: os.environ.get(name) for name in INSTRUCTION_LIMITS},
            "context_tokens": args.context,
            "decode_reps": args.reps,
            "product_reps": args.product_reps,
        },
        "weights_bytes": {weights: _weights_nbytes(model) for weights, (model, _) in models.items()},
        "step_ms": {},
        "decode_tok_s": {},
    }
    weights = [linear.weight.detach() for linear in _linears(models["native"][0])]
    avx2 = build_for_instructions("int8_linear", ["-mno-avx512f"]) if args.avx2 and vectors_available() else None
    for rows in args.rows:
        # On the compute thread, which loaded the models: a second thread's OpenMP team would slow every product.
        step_ms = run_on_compute_thread(step_products, weights, rows, args.product_reps, avx2)
        result["step_ms"][str(rows)] = step_ms
        print(rows, "rows, one step's products (ms):", {k: round(v, 1) for k, v in step_ms.items()}, flush=True)
    del weights
    for agents in () if args.products_only else (1, 15):
        samples = decode_rates(models, args.context, agents, args.reps)
        result["decode_tok_s"][str(agents)] = samples
        print(agents, "agents, tok/s:", {k: [round(v, 1) for v in vs] for k, vs in samples.items()}, flush=True)
    if args.documents and not args.products_only:
        result["perplexity"] = run_on_compute_thread(perplexities, models, args.documents, args.tokens)
        for name, row in result["perplexity"]["paths"].items():
            change = row["change_vs_native_pct"]
            print(f"{name}: perplexity {row['perplexity']:.3f}, {change['mean']:+.2f}% "
                  f"[{change['low']:+.2f}, {change['high']:+.2f}]")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
