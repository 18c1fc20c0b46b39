"""The reference implementation's half of ``python -m benchmarks peer``, run in ITS OWN environment:

    PEER_PYTHON benchmarks/studies/peer_side.py REQUEST.json RESULT.json

The environment holds ``polykv-llm==0.1.0`` (import name ``polykv``), torch, transformers, gguf and
accelerate, and NOT this project, so this file imports neither ``polykv_agents`` nor anything beyond
those. The request names the GGUF model file and carries token ids, so both sides read exactly the
same tokens.

polykv 0.1.0 fails on transformers 5.x in two places, bypassed here without touching its codec:
``SharedKVPool.from_context`` unpacks ``DynamicCache`` items as pairs (they are triples now), so the
prefill is done here and its per-layer K/V handed to the peer's own ``SharedKVPool.encode``; and
``PooledAgent.generate`` passes ``cache_position`` to ``generate`` (refused now), so its body is
repeated here without it. Everything measured is the peer's own compression, storage and decoding:
``encode``, ``get_kv_for_layer``, a fresh full-precision ``DynamicCache`` per call, greedy
``generate`` on the raw question (the peer applies no chat template).
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def _cache_keyword(model) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _PeakRss:
    def __enter__(self):
        self.peak, self._stop = _rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _prefill(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.inference_mode():
        output = model(ids.unsqueeze(0), use_cache=True)
        cache = output.get("cache", output.get("past_key_values"))
    return [(layer.keys, layer.values) for layer in cache.layers]


def _peer_pool(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from polykv.pool import SharedKVPool

    pool = SharedKVPool(head_dim=kv[0][0].shape[-1])
    # as SharedKVPool.from_context does after its prefill
    pool.encode([(k.cpu().float(), v.cpu().float()) for k, v in kv])
    return pool


def _pool_nbytes(pool) -> int:
    return sum(b.q_k.nbytes + b.k_scale.nbytes + b.v_indices.nbytes + b.v_norms.nbytes for b in pool.blocks.values())


def _cache(model, kv) -> DynamicCache:
    cache = DynamicCache()
    for layer_idx, (k, v) in enumerate(kv):
        cache.update(k.to(model.dtype), v.to(model.dtype), layer_idx)
    return cache


def _peer_kv(pool, num_layers: int):
    return [pool.get_kv_for_layer(i) for i in range(num_layers)]


def _continuation_nll(model, kv, continuation: torch.Tensor) -> float:
    """Mean NLL of continuation[1:] given the prefix K/V (the same tokens scored as by our protocol)."""
    cache = _cache(model, kv)
    start = cache.get_seq_length()
    with torch.inference_mode():
        logits = model(
            input_ids=continuation.unsqueeze(0),
            position_ids=torch.arange(start, start + continuation.numel()).unsqueeze(0),
            **{_cache_keyword(model): cache},
        ).logits
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), continuation[1:]).item()


def _answer(model, tokenizer, kv, question: str, max_new_tokens: int) -> str:
    """PooledAgent.generate of polykv 0.1.0, minus the refused ``cache_position``."""
    ids = tokenizer.encode(question, return_tensors="pt")
    cache = _cache(model, kv)
    mask = torch.ones(1, cache.get_seq_length() + ids.shape[1], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, **{_cache_keyword(model): cache}
        )
    return tokenizer.decode(out[0][ids.shape[1] :], skip_special_tokens=True)


def main() -> None:
    import polykv  # first: a wrong environment fails before the model is loaded

    request = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(request["threads"])
    gguf = Path(request["gguf"])
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="auto").eval()
    layers = model.config.num_hidden_layers

    documents = []
    for document in request["documents"]:
        prefix = torch.tensor(document["prefix_ids"])
        continuation = torch.tensor(document["continuation_ids"])
        started = time.perf_counter()
        full_kv = _prefill(model, prefix)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        pool = _peer_pool(full_kv)
        compress_s = time.perf_counter() - started
        nll_full = _continuation_nll(model, full_kv, continuation)
        nll_pool = _continuation_nll(model, _peer_kv(pool, layers), continuation)
        answers, references, answer_s = [], [], []
        for question in request["questions"]:
            started = time.perf_counter()
            answers.append(_answer(model, tokenizer, _peer_kv(pool, layers), question, request["max_new_tokens"]))
            answer_s.append(time.perf_counter() - started)
            references.append(_answer(model, tokenizer, full_kv, question, request["max_new_tokens"]))
        documents.append(
            {
                "prefix_tokens": prefix.numel(),
                "pool_nbytes": _pool_nbytes(pool),
                "fp16_nbytes": sum(k.to(torch.float16).nbytes + v.to(torch.float16).nbytes for k, v in full_kv),
                "claimed_ratio": pool.get_compression_ratio(),
                "prefill_s": prefill_s,
                "compress_s": compress_s,
                "ppl_full": math.exp(nll_full),
                "ppl_pool": math.exp(nll_pool),
                "answers": answers,
                "references": references,
                "answer_s_median": statistics.median(answer_s),
            }
        )
        del full_kv

    # N concurrent agents: each call decodes the pool into its own full-precision cache (the design).
    agents = request["agents"]
    with _PeakRss() as rss:
        caches = [_cache(model, _peer_kv(pool, layers)) for _ in range(agents)]
        kv_peak = _pool_nbytes(pool) + sum(
            layer.keys.nbytes + layer.values.nbytes for cache in caches for layer in cache.layers
        )
        del caches
    result = {
        "package": f"polykv-llm {getattr(polykv, '__version__', '0.1.0')}",
        "documents": documents,
        "agents": agents,
        "kv_bytes_agents_peak": kv_peak,
        "rss_peak_agents": rss.peak,
    }
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
