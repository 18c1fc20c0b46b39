"""Probe: Llama-3.1-8B at 32,768 tokens with 15 agents, **projected** from per-layer costs measured on this machine.

An 8B model's review at 32K tokens does not run here in a session (its prefill alone is hours on 2 cores, and
llama.cpp's beside it more). What does run: the same model cut to 1 and to 2 of its 32 decoder layers (every
matrix at its published shape, random weights, saved and loaded through the package's own path with
``weights="auto"``). Each cut model, in a fresh process, builds a pool over ``--context`` tokens (two lengths) and
times the decode step for 1 and for 15 agents. The difference between the 2-layer and the 1-layer model is one
layer's cost at that length; the 1-layer model less one layer is what does not repeat per layer (the embedding,
the output layer over 128,256 tokens, sampling, the scheduler).

The projection is arithmetic over those measurements, and labelled as such: per layer, bytes (weights, pool,
the prefill's full cache) scale with the number of layers and the pool's with tokens; a step's time per layer is
fitted as ``a + b * tokens`` over the two lengths, and the prefill's as ``c * tokens + d * tokens**2``; then 32
layers at 32,768 tokens. What it leaves out is said in the JSON's ``assumptions``.

    python -m benchmarks.probes.projection_8b --context 2048 --context 8192 \\
        --out benchmarks/results/issue43/projection_Llama-3.1-8B.json

**Random weights**: time and memory only. Writes ``--out`` (JSON with the commit and machine) and its Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.studies.side_process import peak_rss_bytes, rss_bytes

LLAMA_31_8B: dict[str, Any] = {
    # meta-llama/Llama-3.1-8B, config.json (8.03B parameters; its own output layer, untied)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
CUTS = (1, 2)
"""Decoder layers of the cut models: their difference is one layer."""
TARGET_TOKENS = 32_768
AGENTS = (1, 15)
SHORT, LONG = 4, 20
"""Tokens decoded in the two timed runs: a step is their time's difference over 16 tokens (the first run's TTFT,
the prompts' prefill, cancels)."""
REPETITIONS = 3
MIB, GIB = 2**20, 2**30


def _build(layers: int, folder: Path) -> Path:
    """The 8B configuration cut to ``layers`` decoder layers, random weights (seed 0), saved with the embedded
    tokenizer (whose own special tokens it takes, as :func:`benchmarks.real_shapes.build` does)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from polykv_agents.model.loading import embedded_model_file

    gguf = embedded_model_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    values = {**LLAMA_31_8B, "num_hidden_layers": layers}
    values.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _step_ms(agents, questions, tokens_short: int, tokens_long: int) -> float:
    """One decode step's milliseconds for ``len(agents)`` agents answering at once."""
    from polykv_agents.bench.agents import run_batched
    from polykv_agents.sampling.settings import GenerationSettings

    def seconds(tokens: int) -> float:
        return run_batched(agents, questions, GenerationSettings(max_new_tokens=tokens, ignore_eos=True))[1]

    seconds(tokens_short)  # warm-up
    short = statistics.median(seconds(tokens_short) for _ in range(REPETITIONS))
    long = statistics.median(seconds(tokens_long) for _ in range(REPETITIONS))
    return 1000 * (long - short) / (tokens_long - tokens_short)


def measure(folder: str, contexts: list[int]) -> dict[str, Any]:
    """In this process: load with ``weights="auto"``, then per context a pool (its build's time and peak) and the
    decode step for 1 and 15 agents."""
    import torch

    from polykv_agents.agent import PooledAgent
    from polykv_agents.bench.agents import role_prompts
    from polykv_agents.engine import Engine
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.model.heap import release_free_heap
    from polykv_agents.model.weights import weights_of
    from polykv_agents.pool.shared_pool import SharedKVPool

    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
    _reset_peak()
    model, tokenizer = engine.load_model(folder, weights="auto")
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    loaded = {"rss_bytes": rss_bytes(), "peak_bytes": peak_rss_bytes()}
    text = pydoc_documents(1, chars_per_document=200_000)[0]
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    points = []
    for context in contexts:
        release_free_heap()
        rss_before, started = rss_bytes(), time.perf_counter()
        _reset_peak()
        pool = SharedKVPool.prefill_tokens(model, tokenizer, ids[:context])
        pool_s = time.perf_counter() - started
        pool_peak = peak_rss_bytes()
        roles = role_prompts(max(AGENTS))
        agents = [PooledAgent(pool, model, tokenizer, system_prompt=r, engine=engine) for r, _ in roles]
        questions = [q for _, q in roles]
        steps = {str(n): _step_ms(agents[:n], questions[:n], SHORT, LONG) for n in AGENTS}
        points.append({
            "context_tokens": context, "pool_bytes": pool.nbytes, "pool_build_s": pool_s,
            "pool_build_peak_over_rss_bytes": pool_peak - rss_before, "step_ms": steps,
        })  # fmt: skip
        del agents, pool
        print(f"{folder}: {context} tokens: pool {points[-1]['pool_bytes'] / MIB:.1f} MiB in {pool_s:.1f} s, "
              f"step ms {steps}", flush=True)  # fmt: skip
    engine.close()
    return {"weights": weights_of(model), "weights_bytes": sum(storages.values()), "load": loaded,
            "threads": torch.get_num_threads(), "points": points}  # fmt: skip


def _per_layer(one: float, two: float) -> tuple[float, float]:
    """``(per layer, outside the layers)`` from the 1- and 2-layer figures."""
    return two - one, one - (two - one)


def project(cuts: dict[int, dict[str, Any]], contexts: list[int], layers: int, tokens: int) -> dict[str, Any]:
    """The 32-layer model at ``tokens`` tokens, from the cut models' measurements (arithmetic, labelled so)."""
    one, two = cuts[1], cuts[2]
    weights_layer, weights_outside = _per_layer(one["weights_bytes"], two["weights_bytes"])
    by = {c: (p1, p2) for c, p1, p2 in zip(contexts, one["points"], two["points"], strict=True)}
    short, long = contexts[0], contexts[-1]
    pool_layer_token = (by[long][1]["pool_bytes"] - by[long][0]["pool_bytes"]) / long
    projection: dict[str, Any] = {
        "weights_bytes": weights_outside + layers * weights_layer,
        "pool_bytes": layers * pool_layer_token * tokens,
    }
    # A step per layer as a + b * tokens, fitted on the two lengths; the part outside the layers as measured at the
    # longer one (it does not read the pool).
    for agents in map(str, AGENTS):
        per_layer = {c: _per_layer(by[c][0]["step_ms"][agents], by[c][1]["step_ms"][agents]) for c in contexts}
        slope = (per_layer[long][0] - per_layer[short][0]) / (long - short)
        intercept = per_layer[long][0] - slope * long
        step = per_layer[long][1] + layers * (intercept + slope * tokens)
        projection[f"step_ms_{agents}"] = step
        projection[f"decode_tok_s_{agents}"] = int(agents) * 1000 / step
    # The pool's build (prefill and compression) per layer as c * t + d * t^2 through the two lengths.
    build = {c: _per_layer(by[c][0]["pool_build_s"], by[c][1]["pool_build_s"]) for c in contexts}
    (t1, s1), (t2, s2) = (short, build[short][0]), (long, build[long][0])
    quadratic = (s2 / t2 - s1 / t1) / (t2 - t1)
    linear = s1 / t1 - quadratic * t1
    projection["pool_build_s"] = layers * (linear * tokens + quadratic * tokens**2) + build[long][1] * tokens / long
    peaks = [point["pool_build_peak_over_rss_bytes"] for point in by[long]]
    peak_layer, peak_outside = _per_layer(*peaks)
    projection["pool_build_peak_over_rss_bytes"] = (peak_outside + layers * peak_layer) * tokens / long
    base = one["load"]["rss_bytes"] - one["weights_bytes"]  # the process without weights: interpreter, libraries
    projection["rss_after_pool_bytes"] = base + projection["weights_bytes"] + projection["pool_bytes"]
    projection["rss_peak_bytes"] = base + projection["weights_bytes"] + projection["pool_build_peak_over_rss_bytes"]
    return projection


def markdown(result: dict[str, Any]) -> str:
    p, settings = result["projection"], result["settings"]
    commit = (result["provenance"].get("git_commit") or "?")[:7]
    lines = [
        f"**A projection, not a measurement**: Llama-3.1-8B ({settings['layers']} layers, published shapes, random "
        f"weights) at {settings['target_tokens']:,} tokens, from the 1- and 2-layer cuts measured at "
        f"{' and '.join(f'{c:,}' for c in settings['contexts'])} tokens ({result['cuts']['1']['weights']} weights, "
        f"{result['cuts']['1']['threads']} threads, commit {commit}).",
        "",
        "| figure | projected |",
        "|---|---:|",
        f"| weights held | {p['weights_bytes'] / GIB:.2f} GiB |",
        f"| the pool for the document | {p['pool_bytes'] / GIB:.2f} GiB |",
        f"| RSS with the pool built | {p['rss_after_pool_bytes'] / GIB:.2f} GiB |",
        f"| peak RSS while the pool is built | {p['rss_peak_bytes'] / GIB:.2f} GiB |",
        f"| the pool's build (prefill and compression) | {p['pool_build_s'] / 60:.0f} min |",
        f"| decode, 1 agent | {p['step_ms_1']:.0f} ms a step, {p['decode_tok_s_1']:.2f} tok/s |",
        f"| decode, 15 agents at once | {p['step_ms_15']:.0f} ms a step, {p['decode_tok_s_15']:.1f} tok/s |",
        "",
        "Measured per cut and length (ms a step for 1 / 15 agents; the pool's bytes and build):",
        "",
        "| layers | tokens | pool | build | step ms, 1 / 15 agents |",
        "|---:|---:|---:|---:|---:|",
    ]
    for layers, cut in result["cuts"].items():
        for point in cut["points"]:
            lines.append(
                f"| {layers} | {point['context_tokens']:,} | {point['pool_bytes'] / MIB:.1f} MiB "
                f"| {point['pool_build_s']:.1f} s | {point['step_ms']['1']:.1f} / {point['step_ms']['15']:.1f} |"
            )
    lines += ["", *(f"- {a}" for a in result["assumptions"])]
    return "\n".join(lines) + "\n"


ASSUMPTIONS = (
    "Every decoder layer of the 32 costs what the second layer of the cut model added (same shapes, same kernels).",
    "A step's time per layer is linear in the pool's tokens between and beyond the two lengths measured; the "
    "pool's build per layer is linear plus quadratic (attention) in tokens through the same two points.",
    "Peak RSS: the process without weights (measured after the 1-layer load), the weights, and the pool's build "
    "peak over its starting RSS (per layer and outside them, linear in tokens); the 15 agents' own suffixes (tens "
    "of tokens each) are left out.",
    "Not projected: the review's calls (their prompts' prefill over the pool), llama.cpp at this size, a GPU.",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, action="append", help="pool lengths measured (two; default 2K, 8K)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # a model folder and the JSON file to write
    args = parser.parse_args()
    contexts = sorted(args.context or [2048, 8192])
    if args.child:
        Path(args.child[1]).write_text(json.dumps(measure(args.child[0], contexts)))
        return
    if args.out is None or len(contexts) != 2:
        parser.error("--out is required, and two --context lengths")
    from polykv_agents.bench.provenance import Provenance

    cuts = {}
    for layers in CUTS:
        with tempfile.TemporaryDirectory() as folder:
            _build(layers, Path(folder))
            child = Path(folder, "result.json")
            command = [sys.executable, "-m", "benchmarks.probes.projection_8b", "--child", folder, str(child)]
            subprocess.run([*command, *(f"--context={c}" for c in contexts)], check=True)
            cuts[layers] = json.loads(child.read_text())
    result = {
        "probe": "projection_8b",
        "provenance": Provenance.of_this_process().model_dump(mode="json"),
        "settings": {
            "model": "Llama-3.1-8B",
            "published_config": LLAMA_31_8B,
            "random_weights": True,
            "layers": LLAMA_31_8B["num_hidden_layers"],
            "target_tokens": TARGET_TOKENS,
            "contexts": contexts,
            "agents": list(AGENTS),
            "decode_tokens": [SHORT, LONG],
            "repetitions": REPETITIONS,
        },
        "projection_is_measured": False,
        "cuts": {str(k): v for k, v in cuts.items()},
        "projection": project(cuts, contexts, LLAMA_31_8B["num_hidden_layers"], TARGET_TOKENS),
        "assumptions": list(ASSUMPTIONS),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
