"""Probe: the shared prefix kept decoded (``decompressed``) against the pool read as stored (``compressed``, the native
kernel over int8 keys and TurboQuant values), side by side in one process: what ``runtime="auto"`` is decided on.

For each document length, one pool of the embedded SmolLM2 in bfloat16 (pydoc_data.topics text); then, per agent
count, the two residencies alternate (A B A B), each in a fresh engine, each round a warm-up run and ``--reps``
timed runs of the agents answering at once (``--tokens`` tokens each, EOS ignored: equal work). Also the time to a
first token, cold (a fresh engine: the decoded prefix is built inside it) and warm, and one layer's attention
(the kernel over the stored pool, over the decoded prefix, with and without AMX tiles, and PyTorch's fused kernel
over the decoded prefix, which the runtime uses past ``KERNEL_MAX_QUERIES``). Writes ``--out`` (JSON) and prints
a summary:

    python benchmarks/probes/residency.py --out benchmarks/results/issue42/residency.json

The committed JSON says which commit and machine produced it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _layer_ms(pool, rows: int, width: int, tiles: bool | None, stored: bool, reps: int = 20) -> float:
    """Median ms of one layer's attention (layer 0 of ``pool``) for ``rows`` rows of ``width`` tokens, in bfloat16;
    ``tiles=None``: PyTorch's fused kernel over the decoded prefix (the prefix part only)."""
    from polykv_agents.bench.stats import median_call_seconds
    from polykv_agents.runtime.cascade_attention import _attend
    from polykv_agents.runtime.grouped_attention import KernelGroup, grouped_attention
    from polykv_agents.runtime.stored_prefix import stored_layer

    keys, values = pool.decompress_layer(0, dtype=torch.bfloat16)
    kv_heads, dim, groups = keys.shape[1], keys.shape[-1], 3
    gen = torch.Generator().manual_seed(rows)
    query = torch.randn(1, rows * width, kv_heads * groups, dim, generator=gen).bfloat16().transpose(1, 2)[0]
    suffix_keys, suffix_values = (torch.randn(rows, kv_heads, 64, dim, generator=gen).bfloat16() for _ in range(2))
    starts, past = torch.zeros(rows, dtype=torch.long), torch.full((rows,), 64 - width)
    if tiles is None:
        grouped = query.view(kv_heads, groups, rows * width, dim).reshape(1, kv_heads, -1, dim)
        run = lambda: _attend(grouped, keys, values, dim**-0.5)  # noqa: E731
    else:
        prefix = (None, None, stored_layer(pool.layers[0])) if stored else (keys, values, None)
        group = KernelGroup(query, prefix[0], prefix[1], suffix_keys, suffix_values, starts, past, width, prefix[2])
        run = lambda: grouped_attention([group], dim**-0.5, tiles=tiles)  # noqa: E731
    return median_call_seconds(run, reps, warmups=3) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 15])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import pydoc_data.topics

    from polykv_agents import Engine, PooledAgent, SharedKVPool
    from polykv_agents.bench.agents import role_prompts, run_batched
    from polykv_agents.bench.provenance import Provenance
    from polykv_agents.bench.ttft import ttft_pool_cold, ttft_pool_warm
    from polykv_agents.model.loading import load_model_uncached
    from polykv_agents.runtime.grouped_attention import tiles_available
    from polykv_agents.runtime.residency import auto_residency
    from polykv_agents.sampling.settings import GenerationSettings

    model, tokenizer = load_model_uncached(None, torch.bfloat16, "cpu")
    ids = tokenizer("\n".join(pydoc_data.topics.topics.values())[:400_000], return_tensors="pt").input_ids[0]
    settings = GenerationSettings(max_new_tokens=args.tokens, ignore_eos=True)
    result = {
        "probe": "residency",
        "provenance": Provenance.of_this_process().model_dump(mode="json"),
        "settings": {
            "tokens": args.tokens,
            "reps": args.reps,
            "model": "SmolLM2-135M-Instruct",
            "dtype": "bfloat16",
            "threads": torch.get_num_threads(),
            "tiles_available": tiles_available(),
        },
        "contexts": [],
    }
    for context in args.contexts:
        pool = SharedKVPool.prefill(model, tokenizer, tokenizer.decode(ids[:context], skip_special_tokens=True))
        auto = auto_residency(model, pool, compiled_steps=False)
        entry = {"context_tokens": pool.num_tokens, "pool_nbytes": pool.nbytes, "auto": auto, "decode_tok_s": {}}
        entry["ttft_s"] = {}
        for agents in args.agents:
            roles = role_prompts(agents)
            questions = [q for _, q in roles]
            samples: dict[str, list[float]] = {"decompressed": [], "compressed": []}
            for residency in ("decompressed", "compressed") * 2:
                engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
                try:
                    pooled = [PooledAgent(pool, model, tokenizer, system_prompt=r, runtime=residency, engine=engine)
                              for r, _ in roles]  # fmt: skip
                    run_batched(pooled, questions, settings)  # warm-up
                    for _ in range(args.reps):
                        tokens, seconds = run_batched(pooled, questions, settings)
                        samples[residency].append(tokens / seconds)
                finally:
                    engine.close()
            entry["decode_tok_s"][str(agents)] = samples
            print(context, agents, {k: [round(v, 1) for v in vs] for k, vs in samples.items()}, flush=True)
        role, question = role_prompts(1)[0]
        for residency in ("decompressed", "compressed"):
            cold = [ttft_pool_cold(pool, model, tokenizer, role, question, runtime=residency) for _ in range(3)]
            engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
            try:
                agent = PooledAgent(pool, model, tokenizer, system_prompt=role, runtime=residency, engine=engine)
                warm = [ttft_pool_warm(agent, question) for _ in range(3)]
            finally:
                engine.close()
            entry["ttft_s"][residency] = {"cold": cold, "warm": warm}
            print(context, residency, "TTFT cold", [round(x, 3) for x in cold], "warm", [round(x, 3) for x in warm])
        entry["layer_ms"] = {
            f"{rows}x{width}": {
                "stored, tiles": _layer_ms(pool, rows, width, True, True),
                "stored, vectors": _layer_ms(pool, rows, width, False, True),
                "decoded, tiles": _layer_ms(pool, rows, width, True, False),
                "decoded, vectors": _layer_ms(pool, rows, width, False, False),
                "decoded, PyTorch fused (prefix part only)": _layer_ms(pool, rows, width, None, False),
            }
            for rows, width in ((1, 1), (15, 1), (1, 128))
        }
        print(context, "layer ms", json.dumps(entry["layer_ms"]))
        result["contexts"].append(entry)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
