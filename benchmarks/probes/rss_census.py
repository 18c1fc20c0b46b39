"""Probe: what makes up the resident memory of a process that runs the 15-role review, stage by stage.

One fresh process per weights setting (``--weights``, repeatable), as a user's process: the imports, the model
load, a warm-up review (256 tokens), then ``--documents`` reviews of ``--context`` tokens, one after another, as
the peers' probe runs them (graphs/document_review.py, 32 tokens per answer, EOS ignored). After each stage:

- the process's RSS and its peak so far (``VmHWM``);
- what the engine holds in tensors, from their ``nbytes``: the model's weights (parameters and buffers, each
  storage once), the pools (``engine.pools.nbytes``) and the keys and values finished calls left for reuse
  (``engine.schedulers.prefixes.nbytes``), with that cache's hits so far;
- glibc's heap: bytes in use and bytes free but not returned to the system (``mallinfo2``; absent elsewhere);
- at the end, the RSS after ``gc.collect()`` and ``malloc_trim(0)``: what the allocator was holding free.

The imports are measured in steps (torch; transformers and langgraph; transformers' Llama modeling code, which any
process loading a Llama imports, and which brings in ``torch._dynamo`` and ``torch.distributed.tensor``; this
package), so the libraries' share is apart from the work's and this package's own imports apart from transformers'.
Writes ``--out`` (JSON) and prints each stage:

    python -m benchmarks.probes.rss_census --weights auto --weights native \
        --out benchmarks/results/issue42/rss_census.json

The committed JSON says which commit and machine produced it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (all ``size_t``)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with ``mallinfo2`` (2.33+), else ``None``."""
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    if library is None or not hasattr(library, "mallinfo2"):
        return None
    library.mallinfo2.restype = _MallInfo2
    return library


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    msg = f"/proc/self/status has no {field}"
    raise RuntimeError(msg)


def _weights_nbytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied weights share one)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Census:
    """The stages measured so far in this process."""

    def __init__(self) -> None:
        self.glibc = _glibc()
        self.stages: list[dict[str, Any]] = []

    def stage(self, name: str, engine=None, model=None, **extra: Any) -> None:
        row: dict[str, Any] = {"stage": name, "rss_bytes": _status_kib("VmRSS") * 1024,
                               "peak_rss_bytes": _status_kib("VmHWM") * 1024, **extra}  # fmt: skip
        if model is not None:
            row["weights_bytes"] = _weights_nbytes(model)
        if engine is not None:
            prefixes = engine.schedulers.prefixes
            row.update(pools_bytes=engine.pools.nbytes, prefixes_bytes=prefixes.nbytes, prefix_hits=prefixes.hits,
                       prefix_matched_tokens=prefixes.matched_tokens)  # fmt: skip
        if self.glibc is not None:
            info = self.glibc.mallinfo2()
            row.update(heap_in_use_bytes=info.uordblks, heap_free_bytes=info.fordblks, heap_mmapped_bytes=info.hblkhd)
        self.stages.append(row)
        shown = {k: round(v / MIB, 1) if k.endswith("bytes") else v for k, v in row.items() if k != "stage"}
        print(f"{name:34s} {shown}", flush=True)


def one_process(weights: str, context: int, documents: int, graphs: Path) -> dict[str, Any]:
    """The census of this process running the review with ``weights``."""
    census = Census()
    census.stage("python")
    import torch

    census.stage("import torch")
    import langgraph.graph  # noqa: F401
    import transformers

    census.stage("import transformers, langgraph")
    import transformers.models.llama.modeling_llama  # noqa: F401  (any Llama's loading imports it)

    census.stage("import transformers' Llama modeling")
    from benchmarks.studies.graph_e2e import _document, graphs_under_test, run_graph
    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.eval.corpus import pydoc_documents

    census.stage("import polykv_agents")
    workflow = load_workflow("document_review", graphs)
    graph, engine = graphs_under_test(workflow, 32, weights, False)["pooled"]
    model, tokenizer = engine.load_model(None, weights=weights)
    census.stage("model loaded", engine, model)
    roles = [*workflow.ROLE_PROMPTS, "procurement", "quality", "audit", "strategy", "data"][:15]
    texts = pydoc_documents(documents, chars_per_document=60_000)
    run_graph(graph, engine, _document(tokenizer, texts[0], 256, run=-1), roles[:3])
    census.stage("warm-up review (256 tokens)", engine, model)
    for index, text in enumerate(texts):
        run, _ = run_graph(graph, engine, _document(tokenizer, text, context, index), roles)
        census.stage(f"review {index + 1} ({context} tokens)", engine, model, wall_s=run.wall_s)
    import gc

    gc.collect()
    if census.glibc is not None:
        census.glibc.malloc_trim(0)
    census.stage("after gc and malloc_trim", engine, model)
    engine.close()
    from polykv_agents.model.weights import weights_of

    return {"weights": weights, "stored_weights": weights_of(model), "dtype": str(model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "stages": census.stages}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", action="append", default=None, help="auto, native, int8 or int4 (repeatable)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--graphs", type=Path, default=Path("langgraph.json"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child: one weights setting
    args = parser.parse_args()
    weights = args.weights or ["auto"]
    if args.one:
        args.out.write_text(json.dumps(one_process(weights[0], args.context, args.documents, args.graphs)))
        return
    from polykv_agents.bench.provenance import Provenance

    settings = {"model": "SmolLM2-135M-Instruct", "context_tokens": args.context, "documents": args.documents,
                "max_tokens": 32, "roles": 15}  # fmt: skip
    provenance = Provenance.of_this_process().model_dump(mode="json")
    result: dict[str, Any] = {"probe": "rss_census", "provenance": provenance, "settings": settings, "processes": []}
    for setting in weights:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "census.json"
            command = [sys.executable, "-m", "benchmarks.probes.rss_census", "--one", "--weights", setting,
                       "--context", str(args.context), "--documents", str(args.documents), "--graphs",
                       str(args.graphs), "--out", str(out)]  # fmt: skip
            print(f"== weights {setting}", flush=True)
            subprocess.run(command, check=True)
            result["processes"].append(json.loads(out.read_text()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
