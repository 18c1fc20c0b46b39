"""llama.cpp's half of ``python -m benchmarks peers``, run in a fresh process of its own:

    python benchmarks/studies/llamacpp_side.py REQUEST.json RESULT.json

Imports only ``llama_cpp`` (llama-cpp-python, the engine behind LangChain's ``ChatLlamaCpp``) and the standard
library (:mod:`side_process` is standard library too): no torch, so the process's peak RSS is llama.cpp's own.
It loads the same GGUF file the pooled engine loads and replays the exact token ids the pooled graph run read,
call by call, in the graph's order, over ONE context, so llama.cpp's automatic prefix reuse
(``Llama.generate`` keeps the longest common prefix of consecutive prompts) keeps the document between calls.
Each call decodes exactly as many tokens as the pooled call did, greedily; an end-of-sequence token does not
stop it.

Request: ``{"model_path", "n_ctx", "threads", "flash_attn", "cache_types", "reset_every_call", "reviews": [[{"node",
"input_ids", "output_tokens"}]], "probes": [{"document_ids", "prompt_ids", "other_prompt_ids",
"decode_tokens"}]}``: one review and one probe per document. ``cache_types``: the KV cache's ggml types as
``[keys, values]`` names (``["q8_0", "q4_0"]``, as ``--cache-type-k/-v`` take them; quantized values need flash
attention), or absent for f16. Result: ``{"load_s", "reviews", "probes",
"rss_after_load_bytes", "rss_peak_bytes"}``, the review's wall and per-stage time and the probe's figures
(see :func:`probe`) per document.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks.studies.side_process import peak_rss_bytes, rss_bytes

CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}
"""ggml type ids (``llama_cpp.GGML_TYPE_*``) of the cache types a request may name."""

GREEDY = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


def decode(llm, input_ids: list[int], tokens: int) -> tuple[float, float]:
    """``(seconds to the first token, seconds in all)`` of greedy-decoding ``tokens`` after ``input_ids``,
    reusing the longest prefix already in the context."""
    started = time.perf_counter()
    first = 0.0
    generator = llm.generate(input_ids, reset=True, **GREEDY)
    for count, _ in enumerate(generator, start=1):
        if count == 1:
            first = time.perf_counter() - started
        if count >= tokens:
            break
    generator.close()
    return first, time.perf_counter() - started


def replay_review(llm, calls: list[dict], reset_every_call: bool) -> dict:
    """Every call of the review, one after another over one context."""
    stage_s: dict[str, float] = {}
    started = time.perf_counter()
    for call in calls:
        if reset_every_call:
            llm.reset()  # the context keeps nothing: every call prefills its whole prompt again
        _, seconds = decode(llm, call["input_ids"], call["output_tokens"])
        stage_s[call["node"]] = stage_s.get(call["node"], 0.0) + seconds
    return {
        "wall_s": time.perf_counter() - started,
        "stage_s": stage_s,
        "calls": len(calls),
        "output_tokens": sum(call["output_tokens"] for call in calls),
    }


def probe(llm, request: dict) -> dict:
    """Prefill speed; time to first token from scratch (an empty context), cold (the document's saved state
    loaded into an empty context: llama.cpp's analogue of a built pool) and warm (the document in the
    context); single-stream decode speed after the document; the bytes of the state holding the document."""
    document, prompt, other = request["document_ids"], request["prompt_ids"], request["other_prompt_ids"]
    llm.reset()
    started = time.perf_counter()
    llm.eval(document)
    prefill_s = time.perf_counter() - started
    state = llm.save_state()
    llm.reset()
    ttft_scratch, _ = decode(llm, document + prompt, 1)
    llm.reset()
    started = time.perf_counter()
    llm.load_state(state)
    ttft_cold = time.perf_counter() - started + decode(llm, document + prompt, 1)[0]
    ttft_warm, _ = decode(llm, document + other, 1)  # the document is reused, the prompt is new
    tokens = request["decode_tokens"]
    first, total = decode(llm, document + prompt, tokens + 1)
    return {
        "prefill_s": prefill_s,
        "prefill_tok_s": len(document) / prefill_s,
        "ttft_scratch_s": ttft_scratch,
        "ttft_cold_s": ttft_cold,
        "ttft_warm_s": ttft_warm,
        "decode_tok_s": tokens / (total - first),
        "state_bytes": state.llama_state_size,
    }


def main(request_path: str, result_path: str) -> None:
    from llama_cpp import Llama

    request = json.loads(Path(request_path).read_text())
    type_k, type_v = (CACHE_TYPES[name] for name in request.get("cache_types") or ("f16", "f16"))
    started = time.perf_counter()
    llm = Llama(
        model_path=request["model_path"],
        n_ctx=request["n_ctx"],
        n_batch=512,
        n_threads=request["threads"],
        n_threads_batch=request["threads"],
        flash_attn=request["flash_attn"],
        type_k=type_k,
        type_v=type_v,
        verbose=False,
    )
    load_s = time.perf_counter() - started
    result = {"load_s": load_s, "rss_after_load_bytes": rss_bytes(), "reviews": [], "probes": []}
    reviews, probes = request.get("reviews", []), request.get("probes", [])
    if reviews:
        decode(llm, reviews[0][0]["input_ids"][:64], 2)  # warm-up: first passes and allocations
    for review in reviews:
        llm.reset()  # each document's review starts from an empty context, as ours starts from no pool
        result["reviews"].append(replay_review(llm, review, request["reset_every_call"]))
    if probes:
        probe(llm, probes[0])  # warm-up
    result["probes"] = [probe(llm, ids) for ids in probes]
    result["rss_peak_bytes"] = peak_rss_bytes()
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
