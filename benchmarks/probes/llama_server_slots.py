"""Probe: llama-server with N slots, each given its own document and then sent pinned completions (``id_slot``):
does a slot keep its document, and what does the server decode in aggregate, with one unified KV cache
(``--kv-unified``) against a KV cache per slot (``--no-kv-unified``)? Same binary, same prompts, one process each.

    python -m benchmarks.probes.llama_server_slots LLAMA_SERVER F16.gguf [SLOTS]

Run on 2026-12-06 (this project's 2-core machine type, Intel Xeon here; llama.cpp of the llama-cpp-python 0.3.36
sdist built with ``-DGGML_NATIVE=OFF`` and AVX-512; SmolLM2-135M-Instruct F16; 8 slots, 2,048-token documents, 32
tokens per completion, two rounds): unified 5.1 / 5.1 tok/s aggregate, each completion evaluating its whole
document again (14,360 prompt tokens for the 8); a cache per slot 69.5 / 69.4 tok/s, 24 / 16 prompt tokens (an
earlier run of the same code that day: 5.3 / 5.2 against 67.9 / 68.9). Hence
``serve_peers``' default for llama-server (a cache per slot, pinned).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.studies.llama_server import LlamaServer

DOCUMENT_TOKENS = 2048
COMPLETION_TOKENS = 32


def main(binary: Path, gguf: Path, slots: int) -> None:
    # Distinct token ids per slot: every slot's document differs from every other's from its first token.
    documents = [[(i * 7919 + 31 * s) % 40000 + 100 for i in range(DOCUMENT_TOKENS)] for s in range(slots)]
    for unified in (True, False):
        with LlamaServer(
            binary, gguf, slots=slots, ctx_per_slot=DOCUMENT_TOKENS + 352, threads=2, flash_attn=True,
            cache_reuse=256, unified_kv=unified,
        ) as server, ThreadPoolExecutor(slots) as pool:  # fmt: skip
            list(pool.map(lambda s: server.complete(documents[s], 1, slot=s), range(slots)))  # each slot its document
            for round_ in range(2):
                started = time.perf_counter()
                answers = list(
                    pool.map(
                        lambda s, r=round_: server.complete(documents[s] + [5, 6 + r, 7], COMPLETION_TOKENS, slot=s),
                        range(slots),
                    )
                )
                seconds = time.perf_counter() - started
                decoded = sum(a["timings"]["predicted_n"] for a in answers)
                evaluated = sum(a["timings"]["prompt_n"] for a in answers)
                print(
                    f"unified_kv={unified} slots={slots} round {round_}: {decoded / seconds:.1f} tok/s aggregate, "
                    f"{evaluated} prompt tokens evaluated",
                    flush=True,
                )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 8)
