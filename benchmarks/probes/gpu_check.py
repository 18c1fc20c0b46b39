"""Probe for a lent GPU (issue 43, item 4): what the CPU runs cannot say, in one short run (about 3 minutes).

    python -m benchmarks.probes.gpu_check --out "$OUT/gpu_check.json"

Each part is independent (a failure is recorded in the JSON and the next part runs):

1. ``device``: the GPU, its memory, torch and CUDA versions.
2. ``attention``: one layer's prefix attention for SmolLM2's shapes (3 kv heads, 9 query heads, head dim 64) over
   ``--context`` keys, for 1 and 15 agents. The runtime computes a prefix's softmax part on CUDA today with the
   unfused path (float32 scores ``[kv heads, queries, keys]`` and a separate log-sum-exp,
   ``runtime/cascade_attention.py``). PyTorch's fused kernels return the log-sum-exp the cascade merge needs:
   the memory-efficient kernel (``_scaled_dot_product_efficient_attention(..., compute_log_sumexp=True)``, takes
   a mask) and flash attention (``_scaled_dot_product_flash_attention``, no mask: a shared prefix needs none). Their
   outputs and log-sum-exps against the unfused path, and the median ms of each.
3. ``weights``: one decode step's 211 products at SmolLM2's shapes, in bf16 and with int4 weights through
   ``_weight_int4pack_mm`` (tinygemm, the kernel torchao's int4 weight-only uses on CUDA), for 1 and 15 rows.
   The CPU's int8 tile kernel and ``_weight_int8pack_mm``/``_for_cpu`` kernels do not apply on CUDA.
4. ``agents``: the package end to end on ``cuda`` in bf16: the embedded model, a pool of ``--context`` tokens,
   1 and 15 agents decoding ``--tokens`` tokens each at once (EOS ignored), tokens/s; the pool's bytes; the
   time to a first token from the pool; ``torch.cuda.max_memory_allocated``.

Writes ``--out`` (JSON). docs/GPU.md says what each figure decides.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def _cuda_ms(run: Callable[[], object], reps: int = 20) -> float:
    """Median ms of ``run`` on the GPU (CUDA events, after 3 warm-ups)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def device_part() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": props.total_memory / 2**30,
        "capability": f"{props.major}.{props.minor}",
        "bf16": torch.cuda.is_bf16_supported(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def attention_part(context: int) -> dict:
    """Prefix attention by the unfused path and by the two fused kernels that return a log-sum-exp."""
    kv_heads, groups, dim = 3, 3, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(1, kv_heads, context, dim, device="cuda", generator=gen).bfloat16()
    values = torch.randn(1, kv_heads, context, dim, device="cuda", generator=gen).bfloat16()
    out = {}
    for rows in (1, 15):
        # The cascade's layout: every query of a kv head (rows x groups) against one read of the shared prefix.
        query = torch.randn(1, kv_heads, rows * groups, dim, device="cuda", generator=gen).bfloat16()
        out[str(rows)] = _attention_row(query, keys, values, dim**-0.5)
    return out


def _attention_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> dict:
    from polykv_agents.runtime.cascade_attention import _attend_unfused

    kernels = {
        "efficient": lambda: torch.ops.aten._scaled_dot_product_efficient_attention(
            query, keys, values, None, True, scale=scale
        ),
        "flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention(query, keys, values, scale=scale),
    }
    reference_out, reference_lse = _attend_unfused(query, keys, values, scale)
    row = {"unfused_ms": _cuda_ms(lambda: _attend_unfused(query, keys, values, scale))}
    for name, run in kernels.items():
        try:
            result = run()
            fused_out, lse = result[0].float(), result[1].float()
            row[f"{name}_ms"] = _cuda_ms(run)
            row[f"{name}_max_abs_out_difference"] = (fused_out - reference_out).abs().max().item()
            lse = lse[..., : reference_lse.shape[-1]]  # the efficient kernel pads its lse to 32 queries
            row[f"{name}_max_abs_lse_difference"] = (lse - reference_lse).abs().max().item()
        except Exception as error:  # a kernel this GPU or build lacks: recorded, the others still run
            row[f"{name}_error"] = repr(error)
    return row


def weights_part() -> dict:
    """One step's products at SmolLM2's shapes: bf16 against int4 tinygemm."""
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
    shapes.append((49152, 576))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", generator=gen).bfloat16() for n, k in shapes]
    int4 = []
    for weight in weights:
        n, k = weight.shape
        # Two 4-bit codes per byte, [N, K / 2] uint8: what CUDA's packing takes (inner k tiles = 8).
        codes = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack(codes, 8)
        scales_and_zeros = torch.ones(k // 32, n, 2, device="cuda", dtype=torch.bfloat16)
        int4.append((packed, scales_and_zeros))
    out = {}
    for rows in (1, 15):
        xs = [torch.randn(rows, w.shape[1], device="cuda", generator=gen).bfloat16() for w in weights]
        pairs = list(zip(xs, weights, int4, strict=True))
        row = {"bf16_ms": _cuda_ms(lambda pairs=pairs: [torch.nn.functional.linear(x, w) for x, w, _ in pairs])}
        try:
            row["int4_tinygemm_ms"] = _cuda_ms(
                lambda pairs=pairs: [torch.ops.aten._weight_int4pack_mm(x, p, 32, s) for x, _, (p, s) in pairs]
            )
        except Exception as error:
            row["int4_tinygemm_error"] = repr(error)
        out[str(rows)] = row
    return out


def agents_part(context: int, tokens: int) -> dict:
    """The package end to end on CUDA: pool, agents at once, time to a first token, peak GPU memory."""
    import pydoc_data.topics
    import time

    from polykv_agents import Engine, PooledAgent, SharedKVPool
    from polykv_agents.bench.agents import role_prompts, run_batched
    from polykv_agents.model.loading import load_model_uncached
    from polykv_agents.sampling.settings import GenerationSettings

    model, tokenizer = load_model_uncached(None, torch.bfloat16, "cuda")
    text = "\n".join(pydoc_data.topics.topics.values())[:400_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :context]
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    pool = SharedKVPool.prefill(model, tokenizer, tokenizer.decode(ids, skip_special_tokens=True))
    out = {"context_tokens": pool.num_tokens, "pool_nbytes": pool.nbytes, "prefill_s": time.perf_counter() - started}
    settings = GenerationSettings(max_new_tokens=tokens, ignore_eos=True)
    engine = Engine(scheduler_idle_seconds=None)
    try:
        for agents in (1, 15):
            roles = role_prompts(agents)
            pooled = [PooledAgent(pool, model, tokenizer, system_prompt=r, engine=engine) for r, _ in roles]
            run_batched(pooled, [q for _, q in roles], settings)  # warm-up
            decoded, seconds = run_batched(pooled, [q for _, q in roles], settings)
            out[f"decode_tok_s_{agents}"] = decoded / seconds
        role, question = role_prompts(1)[0]
        agent = PooledAgent(pool, model, tokenizer, system_prompt=role, engine=engine)
        started = time.perf_counter()
        next(iter(agent.stream(question, GenerationSettings(max_new_tokens=1))))
        out["ttft_warm_s"] = time.perf_counter() - started
    finally:
        engine.close()
    out["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("no CUDA GPU here: this probe is for a lent GPU machine (see docs/GPU.md)")

    from polykv_agents.bench.provenance import Provenance

    result: dict = {"probe": "gpu_check", "provenance": Provenance.of_this_process().model_dump(mode="json")}
    parts = {
        "device": device_part,
        "attention": lambda: attention_part(args.context),
        "weights": weights_part,
        "agents": lambda: agents_part(args.context, args.tokens),
    }
    for name, part in parts.items():
        try:
            result[name] = part()
        except Exception:  # recorded: one missing kernel must not cost the other parts
            result[name] = {"error": traceback.format_exc()}
        print(name, json.dumps(result[name])[:2000], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
