"""Our half of ``python -m benchmarks peers``, run in a fresh process of its own, as llama.cpp's half is:

    python benchmarks/studies/ours_side.py REQUEST.json RESULT.json

One process per (weights setting, context): it loads the model once, as a user's process does, so its peak
RSS (``VmHWM``, the same measure as llama.cpp's side) is one model's and one setting's, never several copies'.
It runs the 15-role review graph once on each document (its calls recorded token for token, for llama.cpp to
replay), all of them before any probe, so the reviews' memory is a review process's alone; then the probe (TTFT,
decode and prefill speed, KV bytes) over each document. The native kernels are built (or found in torch's
extension cache) before the load is timed: ``load_s`` is a load, never a first build's 30 s a kernel.

Request: ``{"weights", "compiled", "graphs", "max_tokens", "roles", "context", "texts": [str]}`` and optionally
``"model"`` (a local model folder, such as :mod:`benchmarks.real_shapes` makes; default: the embedded model);
document ``i`` is the first ``context`` tokens of ``texts[i]``. Result: ``{"reviews", "replays", "probes",
"probe_ids", "load_s", "warm_up_s", "rss_after_load_bytes", "rss_peak_bytes", "rss_stage_peak_bytes", "weights"}``,
one entry per document in each list; ``rss_stage_peak_bytes`` is each stage's own peak (the load, the warm-up, the
reviews, the probes: :class:`StagePeaks`), so a review's memory is told from the probe's extra caches.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.studies.side_process import peak_rss_bytes, rss_bytes
from polykv_agents.kernels import native_kernel

AGENTS = 15
KERNELS = ("int8_linear", "grouped_attention")
"""The native kernels a review may call (:mod:`polykv_agents.kernels`), built before anything is timed."""


def _single_stream(agent, question: str, tokens: int) -> float:
    """Decode tokens per second of one agent after its first token (prefix resident)."""
    from polykv_agents.sampling.settings import GenerationSettings

    settings = GenerationSettings(max_new_tokens=tokens + 1, ignore_eos=True)
    first = 0.0
    for count, _ in enumerate(agent.generate_ids(question, settings), start=1):
        if count == 1:
            first = time.perf_counter()
    return tokens / (time.perf_counter() - first)


def _tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds


def probe(model, tokenizer, document: str, decode_tokens: int, compiled: bool) -> tuple[dict, dict]:
    """Our figures outside the graph over ``document``, and the token ids llama.cpp's probe reads (the same)."""
    import torch

    from polykv_agents.agent import PooledAgent
    from polykv_agents.bench.agents import role_prompts, run_batched
    from polykv_agents.bench.stats import median_after_warmup
    from polykv_agents.bench.ttft import ttft_pool_cold, ttft_pool_warm, ttft_reprefill
    from polykv_agents.engine import Engine
    from polykv_agents.pool.prefill import prefill_cache
    from polykv_agents.pool.shared_pool import SharedKVPool
    from polykv_agents.runtime.residency import auto_residency
    from polykv_agents.sampling.settings import GenerationSettings

    pool = SharedKVPool.prefill(model, tokenizer, document)

    def prefill_seconds() -> float:
        started = time.perf_counter()
        prefill_cache(model, pool.token_ids)
        return time.perf_counter() - started

    prefill_s = median_after_warmup(1, prefill_seconds)
    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0, compile_decode=compiled)
    engine.warm_up_decode(model, tokenizer, pool)  # with compiled: the graph engine's model has its graphs
    roles = role_prompts(AGENTS)
    agents = [PooledAgent(pool, model, tokenizer, system_prompt=r, engine=engine) for r, _ in roles]
    questions = [q for _, q in roles]
    ttft_cold = median_after_warmup(1, lambda: ttft_pool_cold(pool, model, tokenizer, roles[0][0], questions[0]))
    ttft_warm = ttft_pool_warm(agents[1], questions[1])
    prompt = agents[0].prompt_ids(questions[0])
    ttft_scratch = median_after_warmup(1, lambda: ttft_reprefill(model, pool, prompt))
    single = median_after_warmup(1, lambda: _single_stream(agents[0], questions[0], decode_tokens))
    settings = GenerationSettings(max_new_tokens=decode_tokens, ignore_eos=True)
    aggregate = median_after_warmup(1, lambda: _tokens_per_s(*run_batched(agents, questions, settings)))
    # The residency the agents' default runtime ("auto") served them from, and what it held beyond the pool.
    residency = auto_residency(model, pool, compiled_steps=compiled)
    scheduler = engine.schedulers.scheduler_for(model, tokenizer, pool, residency)
    resident = pool.nbytes + scheduler.prefix.peak_held_nbytes
    if compiled:  # figures labelled compiled must not come from eager steps
        engine.schedulers.require_compiled()
    engine.close()
    figures = {
        "prefill_tok_s": pool.num_tokens / prefill_s,
        "ttft_scratch_s": ttft_scratch,
        "ttft_cold_s": ttft_cold,
        "ttft_warm_s": ttft_warm,
        "decode_tok_s": single,
        "decode_tok_s_15": aggregate,
        "kv_bytes": pool.nbytes,
        "kv_bytes_resident": resident,
        "residency": residency,
    }
    ids = {
        "document_ids": pool.token_ids.tolist(),
        "prompt_ids": agents[0].prompt_ids(questions[0]).tolist(),
        "other_prompt_ids": agents[1].prompt_ids(questions[1]).tolist(),
        "decode_tokens": decode_tokens,
        "agent_prompts": [
            torch.cat([pool.token_ids, a.prompt_ids(q)]).tolist() for a, q in zip(agents, questions, strict=True)
        ],
    }
    return figures, ids


class StagePeaks:
    """Each stage's own peak RSS: the kernel's high-water mark (``VmHWM``) read at the stage's end, then reset to
    the RSS of the moment (``/proc/self/clear_refs``), so the next stage's peak is its own. The process's peak is
    the largest of them. A stage run several times (a review per document) keeps its largest."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    def end(self, stage: str) -> None:
        self.peaks[stage] = max(self.peaks.get(stage, 0), peak_rss_bytes())
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def measure(request: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, then the review and the probe over each document."""
    from benchmarks.studies.graph_e2e import _document, graphs_under_test, run_graph
    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.model.weights import weights_of

    workflow = load_workflow("document_review", Path(request["graphs"]))
    weights, compiled = request["weights"], request["compiled"]
    name = request.get("model")
    graph, engine = graphs_under_test(workflow, request["max_tokens"], weights, compiled, model=name)["pooled"]
    for kernel in KERNELS:  # a first build (new sources, a new checkout) is not the load's time
        native_kernel(kernel)
    started = time.perf_counter()
    model, tokenizer = engine.load_model(name, weights=weights)
    load_s = time.perf_counter() - started
    rss_after_load = rss_bytes()
    peaks = StagePeaks()
    peaks.end("load")  # imports and the model's load
    roles = request["roles"]
    started = time.perf_counter()
    # With the compiled step, the prefetch node compiles every batch bucket here (cold or from Inductor's cache).
    run_graph(graph, engine, _document(tokenizer, request["texts"][0], 256, run=-1), roles[:3])
    warm_up_s = time.perf_counter() - started
    peaks.end("warm_up")
    result: dict[str, Any] = {"reviews": [], "replays": [], "probes": [], "probe_ids": []}
    documents = [_document(tokenizer, text, request["context"], i) for i, text in enumerate(request["texts"])]
    for document in documents:
        run, calls = run_graph(graph, engine, document, roles)
        if compiled:  # now, while the review's scheduler is live (an idle one retires during the probe)
            engine.schedulers.require_compiled()
        peaks.end("reviews")
        result["reviews"].append(
            {"wall_s": run.wall_s, "stage_s": run.stage_s, "calls": len(calls),
             "output_tokens": sum(c.output_tokens for c in calls)}
        )  # fmt: skip
        result["replays"].append(
            [{"node": c.node, "input_ids": c.input_ids, "output_tokens": c.output_tokens} for c in calls]
        )
    for document in documents:
        figures, ids = probe(model, tokenizer, document, request["max_tokens"], compiled)
        peaks.end("probes")
        result["probes"].append(figures)
        result["probe_ids"].append(ids)
    engine.close()
    result.update(load_s=load_s, warm_up_s=warm_up_s, rss_after_load_bytes=rss_after_load,
                  rss_peak_bytes=max(peaks.peaks.values()), rss_stage_peak_bytes=peaks.peaks,
                  weights=weights_of(model))  # ``auto`` resolved here  # fmt: skip
    return result


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    Path(result_path).write_text(json.dumps(measure(request)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
