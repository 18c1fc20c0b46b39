"""Probe: a process's resident memory at a model's load and at a document's prefill, each stage's own peak.

One fresh process per ``--weights`` setting loads the model (the embedded SmolLM2, or a model of
:mod:`benchmarks.real_shapes` by ``--model``), then prefills ``--context`` tokens of a pydoc text into a full
cache, then builds a pool over the same tokens. After each stage: the RSS, the stage's own peak (the kernel's
high-water mark is reset before it, ``/proc/self/clear_refs``), and the bytes of what it made (the weights, the
cache, the pool) from their tensors' ``nbytes``. Memory only: run times are printed for orientation, not results.

    python -m benchmarks.probes.load_memory --model Llama-3.2-1B --context 8192 --weights auto \\
        --out benchmarks/results/issue43/load_memory_Llama-3.2-1B.json

The committed JSON says which commit and machine produced it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 2**20


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _stage(name: str, started_rss: int, started: float, **made: int) -> dict[str, Any]:
    """The stage's figures; resets the high-water mark for the next one."""
    figures = {
        "stage": name,
        "rss_bytes": _status_bytes("VmRSS"),
        "rss_before_bytes": started_rss,
        "stage_peak_bytes": _status_bytes("VmHWM"),
        "seconds": time.perf_counter() - started,
        **made,
    }
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    print(
        f"{name}: RSS {figures['rss_bytes'] / MIB:,.0f} MiB, the stage's peak {figures['stage_peak_bytes'] / MIB:,.0f}"
        + "".join(f", {key} {value / MIB:,.1f} MiB" for key, value in made.items()),
        flush=True,
    )
    return figures


def measure(model_name: str | None, weights: str, context: int) -> dict[str, Any]:
    """In this process: load, prefill, pool; each stage's figures."""
    import torch

    from polykv_agents.engine import Engine
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.model.heap import release_free_heap
    from polykv_agents.model.weights import weights_of
    from polykv_agents.pool.prefill import prefill_cache
    from polykv_agents.pool.shared_pool import SharedKVPool

    stages = [_stage("imports", 0, time.perf_counter())]
    rss, started = _status_bytes("VmRSS"), time.perf_counter()
    model, tokenizer = Engine(scheduler_idle_seconds=None).load_model(model_name, weights=weights)
    storages = [t.untyped_storage() for t in [*model.parameters(), *model.buffers()]]
    tensors = {storage.data_ptr(): storage.nbytes() for storage in storages}  # each storage once (tied ones)
    stages.append(_stage("model loaded", rss, started, weights_bytes=sum(tensors.values())))
    text = pydoc_documents(1, chars_per_document=120_000)[0]
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :context]
    rss, started = _status_bytes("VmRSS"), time.perf_counter()
    cache, _ = prefill_cache(model, ids)
    release_free_heap()  # the chunks' activations, as a pool's build hands them back: the cache is what stays
    cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    stages.append(_stage(f"prefill of {len(ids)} tokens, full cache held", rss, started, cache_bytes=cache_bytes))
    del cache
    release_free_heap()
    rss, started = _status_bytes("VmRSS"), time.perf_counter()
    pool = SharedKVPool.prefill(model, tokenizer, tokenizer.decode(ids))
    stages.append(_stage("a pool built over the same tokens", rss, started, pool_bytes=pool.nbytes))
    return {"weights": weights, "stored_weights": weights_of(model), "dtype": str(model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "stages": stages}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model of benchmarks.real_shapes (default: the embedded SmolLM2)")
    parser.add_argument("--weights", action="append", help="auto (default), native, int8, int4 (repeatable)")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one setting, in this process: a JSON file to write
    args = parser.parse_args()
    model = None
    if args.model:
        from benchmarks.real_shapes import build

        model = str(build(args.model))
    if args.child:
        Path(args.child).write_text(json.dumps(measure(model, args.weights[0], args.context)))
        return
    if args.out is None:
        parser.error("--out is required")
    from polykv_agents.bench.provenance import Provenance

    result: dict[str, Any] = {
        "probe": "load_memory",
        "provenance": Provenance.of_this_process().model_dump(mode="json"),
        "settings": {"model": args.model or "SmolLM2-135M-Instruct", "context_tokens": args.context},
        "processes": [],
    }
    for weights in args.weights or ["auto"]:
        with tempfile.TemporaryDirectory() as folder:
            child = Path(folder, "result.json")
            command = [sys.executable, "-m", "benchmarks.probes.load_memory", "--weights", weights]
            command += ["--context", str(args.context), "--child", str(child)]
            command += ["--model", args.model] if args.model else []
            subprocess.run(command, check=True)
            result["processes"].append(json.loads(child.read_text()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
