"""``python -m benchmarks peer``: side by side with the published reference implementation,
``polykv-llm`` 0.1.0 (import name ``polykv``), on the same model, tokens and questions.

The peer runs in its own environment (``--peer-python``), through :mod:`.peer_side`, so it never
shares a process or a dependency set with this project. Both sides measure the same things the same
way: bytes from the ``nbytes`` of the stored tensors, perplexity of the same continuation tokens after
the same prefix tokens, answers to the same questions (each side in its own prompt format: the peer
sends the raw question, this project the chat template) compared with that side's own
full-precision answers, wall time of prefill, compression and answering, and the KV bytes and process
RSS with N agents at once.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import Field, FilePath
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from benchmarks.studies.peers_writer import measure_text
from benchmarks.studies.side_process import SideProcessError, run_side
from polykv_agents.agent import PooledAgent
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.memory import runtime_peak
from polykv_agents.bench.output import Column, Progress, SuiteResult, column, write_suite
from polykv_agents.bench.quality import QUESTIONS, Similarity
from polykv_agents.bench.suite import SuiteOptions, TableSuite, load_model_for
from polykv_agents.config import CompressionConfig
from polykv_agents.eval.agreement import exact_match, token_f1
from polykv_agents.eval.perplexity import continuation_nll
from polykv_agents.model.loading import embedded_model_file
from polykv_agents.pool.prefill import prefill_cache
from polykv_agents.pool.shared_pool import SharedKVPool

PEER_SIDE = Path(__file__).with_name("peer_side.py")


class PeerRunError(ValueError):
    """The peer's environment could not run it (a ``ValueError``: the ``--peer-python`` given is bad)."""


def _run_peer(peer_python: str, request: dict, timeout_s: float) -> dict:
    try:
        return run_side(PEER_SIDE, request, what="the peer run", timeout_s=timeout_s, python=peer_python)
    except SideProcessError as e:
        tail = "\n".join(e.stderr.strip().splitlines()[-15:])
        msg = (
            f"the peer run failed (exit {e.returncode}) in {peer_python}; it needs an environment with "
            f"polykv-llm==0.1.0, torch, transformers, gguf and accelerate:\n{tail}"
        )
        raise PeerRunError(msg) from e


def _ours(model, tokenizer, prefix: torch.Tensor, continuation: torch.Tensor, max_new_tokens: int) -> dict:
    started = time.perf_counter()
    cache, _ = prefill_cache(model, prefix)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    pool = SharedKVPool.from_cache(model, tokenizer, cache, prefix)
    compress_s = time.perf_counter() - started
    full = SharedKVPool.from_cache(model, tokenizer, cache, prefix, config=CompressionConfig.full_precision())
    start = prefix.numel()
    nll_full = continuation_nll(model, full.to_cache(model), continuation, start)
    nll_pool = continuation_nll(model, pool.to_cache(model), continuation, start)
    agent, reference = PooledAgent(pool, model, tokenizer), PooledAgent(full, model, tokenizer, runtime="private")
    answers, references, answer_s = [], [], []
    for question in QUESTIONS:
        started = time.perf_counter()
        answers.append(agent.generate(question, max_new_tokens=max_new_tokens))
        answer_s.append(time.perf_counter() - started)
        references.append(reference.generate(question, max_new_tokens=max_new_tokens))
    return {
        "prefix_tokens": prefix.numel(),
        "pool_nbytes": pool.nbytes,
        "fp16_nbytes": pool.fp16_nbytes,
        "prefill_s": prefill_s,
        "compress_s": compress_s,
        "ppl_full": math.exp(nll_full),
        "ppl_pool": math.exp(nll_pool),
        "answers": answers,
        "references": references,
        "answer_s_median": statistics.median(answer_s),
        "pool": pool,
    }


def _summary(documents: Sequence[dict], similarity: Similarity | None) -> dict:
    answers = [a for d in documents for a in d["answers"]]
    references = [r for d in documents for r in d["references"]]
    summary = {
        "pool_nbytes": statistics.fmean(d["pool_nbytes"] for d in documents),
        "ratio_vs_fp16": statistics.fmean(d["fp16_nbytes"] / d["pool_nbytes"] for d in documents),
        "ppl_delta_pct": statistics.fmean(100 * (d["ppl_pool"] / d["ppl_full"] - 1) for d in documents),
        "prefill_s": statistics.median(d["prefill_s"] for d in documents),
        "compress_s": statistics.median(d["compress_s"] for d in documents),
        "answer_s": statistics.median(d["answer_s_median"] for d in documents),
        "exact_match": statistics.fmean(exact_match(a, r) for a, r in zip(answers, references, strict=True)),
        "token_f1": statistics.fmean(token_f1(a, r) for a, r in zip(answers, references, strict=True)),
    }
    if similarity is not None:
        summary["minilm_cosine"] = statistics.fmean(similarity(answers, references))
    return summary


# metric -> (label, whether lower is better)
METRICS: dict[str, tuple[str, bool]] = {
    "pool_nbytes": ("pool bytes (measured)", True),
    "ratio_vs_fp16": ("x smaller than the fp16 cache (measured)", False),
    "ppl_delta_pct": ("PPL delta % vs full precision", True),
    "prefill_s": ("prefill s", True),
    "compress_s": ("compress s", True),
    "answer_s": ("one answer s (median)", True),
    "exact_match": ("answers equal to full precision", False),
    "token_f1": ("token F1 vs full precision", False),
    "minilm_cosine": ("MiniLM cosine vs full precision", False),
    "kv_bytes_agents_peak": ("KV bytes, N agents at once", True),
    "rss_peak_agents": ("process peak RSS, N agents at once", True),
}


def run_peer_suite(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    peer_python: str,
    context_tokens: int = 2048,
    continuation_tokens: int = 512,
    max_new_tokens: int = 32,
    agents: int = 15,
    similarity: Similarity | None = None,
    timeout_s: float = 3600,
    progress: Progress = lambda _: None,
) -> SuiteResult:
    """Run both sides; one row per metric with both values and the better side."""
    token_ids = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() < context_tokens + continuation_tokens:
            msg = f"a text has {ids.numel()} tokens, fewer than context + continuation"
            raise ValueError(msg)
        token_ids.append((ids[:context_tokens], ids[context_tokens : context_tokens + continuation_tokens]))
    request = {
        "gguf": str(embedded_model_file()),
        "threads": torch.get_num_threads(),
        "documents": [{"prefix_ids": p.tolist(), "continuation_ids": c.tolist()} for p, c in token_ids],
        "questions": list(QUESTIONS),
        "max_new_tokens": max_new_tokens,
        "agents": agents,
    }
    progress("the peer, in its own environment")
    peer = _run_peer(peer_python, request, timeout_s)
    ours_documents = []
    for index, (prefix, continuation) in enumerate(token_ids):
        progress(f"ours: document {index + 1}/{len(token_ids)}")
        ours_documents.append(_ours(model, tokenizer, prefix, continuation, max_new_tokens))
    progress(f"ours: {agents} agents at once")
    kv_peak, _, rss_peak, _ = runtime_peak(ours_documents[-1]["pool"], model, tokenizer, agents, 8)
    ours = {**_summary(ours_documents, similarity), "kv_bytes_agents_peak": kv_peak, "rss_peak_agents": rss_peak}
    theirs = {
        **_summary(peer["documents"], similarity),
        "kv_bytes_agents_peak": peer["kv_bytes_agents_peak"],
        "rss_peak_agents": peer["rss_peak_agents"],
    }
    rows = []
    for key, (label, lower_is_better) in METRICS.items():
        if key not in ours or key not in theirs:
            continue
        a, b = ours[key], theirs[key]
        better = "tie" if math.isclose(a, b, rel_tol=0.02, abs_tol=1e-9) else (
            "ours" if (a < b) == lower_is_better else "polykv-llm"
        )  # fmt: skip
        rows.append({"metric": key, "label": label, "ours": a, "peer": b, "better": better})
    examples = [
        {"question": q, "ours": o, "peer": p}
        for q, o, p in zip(QUESTIONS, ours_documents[0]["answers"], peer["documents"][0]["answers"], strict=True)
    ]
    return SuiteResult(
        suite="peer",
        info=RunInfo.collect(model),
        settings={
            "peer": peer["package"],
            "documents": len(texts),
            "context_tokens": context_tokens,
            "continuation_tokens": continuation_tokens,
            "questions_per_document": len(QUESTIONS),
            "max_new_tokens": max_new_tokens,
            "agents": agents,
            "our_config": CompressionConfig().label(),
        },
        rows=rows,
        summary={"peer_claimed_ratio": peer["documents"][0]["claimed_ratio"], "examples": examples},
    )


class PeerOptions(SuiteOptions):
    peer_python: FilePath
    """Python of an environment with polykv-llm==0.1.0."""
    documents: int = Field(default=3, ge=1)
    """Disjoint pydoc_data.topics texts to average over."""
    context_tokens: int = Field(default=2048, ge=16)
    """Document tokens in the pool."""
    continuation_tokens: int = Field(default=512, ge=2)
    """Tokens whose perplexity is measured."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Tokens per answer."""
    agents: int = Field(default=15, ge=1, le=64)
    """Agents at once for the memory rows."""


def _measure(options: PeerOptions, progress: Progress) -> SuiteResult:
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.eval.embeddings import minilm_similarity

    texts = pydoc_documents(options.documents)
    model, tokenizer = load_model_for(None)  # the peer loads the same embedded GGUF file
    return run_peer_suite(
        model, tokenizer, texts, peer_python=str(options.peer_python), context_tokens=options.context_tokens,
        continuation_tokens=options.continuation_tokens, max_new_tokens=options.max_new_tokens,
        agents=options.agents, similarity=minilm_similarity(), progress=progress,
    )  # fmt: skip


def write_peer(result: SuiteResult, out_dir: Path) -> list[Path]:
    columns = [
        column("measure", "label"),
        Column("polykv_agents", lambda r: measure_text(r["metric"], r["ours"])),
        Column(result.settings["peer"], lambda r: measure_text(r["metric"], r["peer"])),
        column("better", "better"),
    ]
    examples = "\n".join(
        f"- *{e['question']}*\n  - ours: {e['ours'].strip()!r}\n  - polykv-llm: {e['peer'].strip()!r}"
        for e in result.summary["examples"]
    )
    notes = [
        f"polykv-llm reports its own ratio as {result.summary['peer_claimed_ratio']:.2f}x (a formula); the "
        "row above is the ratio measured from its stored tensors. Answer agreement compares each side with its "
        "own full-precision answers to the same questions (polykv-llm sends the raw question, polykv_agents "
        "the chat template). The N-agents rows: polykv-llm decodes the pool into a full-precision cache per "
        "call (N alive at once); polykv_agents runs the N agents through its batched runtime over one shared "
        "prefix. Both processes hold the model's weights as well.",
        "First document's answers:\n\n" + examples,
    ]
    return write_suite(result, out_dir, title="Peer: polykv-llm 0.1.0", columns=columns, notes=notes)


SUITE = TableSuite(
    "peer",
    "Side by side with the reference implementation polykv-llm 0.1.0, run in its own environment.",
    PeerOptions,
    _measure,
    write_peer,
    command="python -m benchmarks peer --peer-python PEER_VENV/bin/python",
    reproduce=(),  # needs a separate environment: benchmarks/run_all.sh runs it when given one
)
