"""Load and soak on the embedded SmolLM2-135M-Instruct: the figures of docs/RELIABILITY.md.

    python benchmarks/load_soak.py --out benchmarks/results/load_soak.json

Load: 200 different (role, question) calls over 15 roles and one pool of a pydoc_data.topics document,
invoked alone one by one (the reference), then all 200 at once from threads and from asyncio through
the batched scheduler; every answer must equal its reference. The first 30 references are also checked
against ``runtime="private"`` (HF's own attention over a private decoded copy of the pool).

Soak: 300 runs of graphs/role_swarm.py (3 roles + aggregator, SQLite checkpointer, a new document and
thread per run, so every run builds a new pool) in this one process, with RSS, live tensors and
threads sampled every 10 runs; growth is reported from run 100 (after the warm-up) to run 300. The
registry budget is 64 MiB here (each pool is about 2.5 MiB), so the steady state is reached in the run.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graphs/ lives next to the package

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver

from graphs import role_swarm
from polykv_agents import SharedKVPool, load_model
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.load import load_cases, run_load
from polykv_agents.bench.soak import growth, run_soak
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.eval import pydoc_documents
from polykv_agents.pool.handle import PoolHandle
from polykv_agents.pool.registry import POOL_REGISTRY

ROLES = [
    "analyst", "skeptic", "optimist", "economist", "engineer", "lawyer", "customer", "teacher",
    "auditor", "editor", "student", "manager", "tester", "historian", "designer",
]  # fmt: skip


def _document(tokenizer, text: str, tokens: int, tag: str) -> str:
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:tokens]
    return f"({tag})\n" + tokenizer.decode(ids, skip_special_tokens=True)


def load_section(args, model, tokenizer, text: str) -> dict:
    document = _document(tokenizer, text, args.load_context, "load")
    pool = SharedKVPool.prefill(model, tokenizer, [{"role": "user", "content": document}])
    chat = ChatPolyKV(max_tokens=args.load_tokens).with_pool(pool)
    cases = load_cases(args.calls, ROLES)
    chat.invoke(cases[0].messages())  # warm-up
    results, answers = run_load(chat, cases)
    private = ChatPolyKV(max_tokens=args.load_tokens, runtime="private").with_pool(pool)
    checked = [str(private.invoke(case.messages()).content) for case in cases[: args.private_checks]]
    private_mismatches = sum(a != b for a, b in zip(checked, answers["sequential"], strict=False))
    for result in results:
        print(json.dumps(asdict(result)), flush=True)
    return {
        "context_tokens": pool.num_tokens,
        "max_tokens": args.load_tokens,
        "roles": len(ROLES),
        "distinct_answers": len(set(answers["sequential"])),
        "results": [asdict(r) for r in results],
        "private_checked": len(checked),
        "private_mismatches": private_mismatches,
    }


def soak_section(args, tokenizer, text: str) -> dict:
    POOL_REGISTRY.max_bytes = args.budget_mib * 1024 * 1024
    with tempfile.TemporaryDirectory() as tmp:
        conn = sqlite3.connect(Path(tmp) / "threads.sqlite", check_same_thread=False)
        saver = SqliteSaver(conn, serde=JsonPlusSerializer(allowed_msgpack_modules=[PoolHandle]))
        graph = role_swarm.build_graph(max_tokens=args.soak_tokens, checkpointer=saver)

        def invoke(run: int):
            state = {
                "document": _document(tokenizer, text, args.soak_context, f"soak copy {run}"),
                "question": "What is the main point?",
                "roles": ROLES[:3],
            }
            return graph.invoke(state, {"configurable": {"thread_id": f"soak-{run}"}})

        def check(run: int, result) -> None:
            if len(result["answers"]) != 3 or not result["answer"]:
                msg = f"run {run} did not complete: {result}"
                raise RuntimeError(msg)
            if run % 25 == 0:
                print(f"soak run {run}", flush=True)

        samples = run_soak(invoke, runs=args.runs, sample_every=10, check=check)
        conn.close()
    grew = growth(samples, warmup_runs=args.warmup_runs)
    print(json.dumps(asdict(grew)), flush=True)
    return {
        "runs": args.runs,
        "context_tokens": args.soak_context,
        "max_tokens": args.soak_tokens,
        "roles": 3,
        "calls_per_run": 4,
        "registry_budget_bytes": POOL_REGISTRY.max_bytes,
        "registry_evictions": POOL_REGISTRY.evictions,
        "builds": POOL_REGISTRY.build_count,
        "seconds": samples[-1].seconds,
        "growth": asdict(grew),
        "samples": [asdict(s) for s in samples],
    }


def render_markdown(result: dict) -> str:
    """The tables docs/RELIABILITY.md quotes."""
    info = RunInfo.model_validate(result["run_info"])
    load, soak = result["load"], result["soak"]
    sequential = next(r for r in load["results"] if r["mode"] == "sequential")
    lines = [
        f"Machine: {info.sentence()}.",
        "",
        f"**Load**: {load['results'][0]['calls']} different calls over {load['roles']} roles, one pool of "
        f"{load['context_tokens']} tokens, greedy, at most {load['max_tokens']} new tokens each.",
        "",
        "| how | wall time | answers different from the same call alone |",
        "|---|---:|---:|",
    ]
    for r in load["results"]:
        speed = "" if r["mode"] == "sequential" else f" ({sequential['seconds'] / r['seconds']:.1f}x faster)"
        how = {"sequential": "one by one (the reference)", "threads": "all at once, threads (`batch`)"}.get(
            r["mode"], "all at once, asyncio (`gather` of `ainvoke`)"
        )
        lines.append(f"| {how} | {r['seconds']:.1f} s{speed} | {r['mismatches']} of {r['calls']} |")
    lines += [
        "",
        f'The first {load["private_checked"]} references also equal `runtime="private"` (transformers\' own '
        f"attention over a private decoded copy): {load['private_checked'] - load['private_mismatches']} of "
        f"{load['private_checked']}. Distinct answers among the references: {load['distinct_answers']}.",
        "",
        f"**Soak**: {soak['runs']} runs of `graphs/role_swarm.py` ({soak['roles']} roles + aggregator, "
        f"{soak['max_tokens']} tokens per answer, SQLite checkpointer, a new document of {soak['context_tokens']} "
        f"tokens and a new thread per run) in one process, {soak['seconds'] / 60:.1f} min; "
        f"registry budget {soak['registry_budget_bytes'] / 2**20:.0f} MiB, {soak['builds']} pools built, "
        f"{soak['registry_evictions']} evicted.",
        "",
        "| run | RSS | live tensors | live tensor bytes | threads |",
        "|---:|---:|---:|---:|---:|",
    ]
    samples = soak["samples"]
    shown = [s for s in samples if s["run"] % 50 == 0 or s is samples[-1]]
    for sample in shown:
        lines.append(
            f"| {sample['run']} | {sample['rss_bytes'] / 2**20:.0f} MiB | {sample['live_tensors']} | "
            f"{sample['live_tensor_bytes'] / 2**20:.1f} MiB | {sample['threads']} |"
        )
    g = soak["growth"]
    lines += [
        "",
        f"Growth from run {g['from_run']} to run {g['to_run']}: RSS {g['rss_bytes'] / 2**20:+.1f} MiB, live tensors "
        f"{g['live_tensors']:+d} ({g['live_tensor_bytes'] / 2**20:+.1f} MiB), threads {g['threads']:+d}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--load-context", type=int, default=1024)
    parser.add_argument("--load-tokens", type=int, default=16)
    parser.add_argument("--private-checks", type=int, default=30)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--warmup-runs", type=int, default=100)
    parser.add_argument("--soak-context", type=int, default=256)
    parser.add_argument("--soak-tokens", type=int, default=8)
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/load_soak.json"))
    parser.add_argument("--render-only", action="store_true", help="only rewrite the .md from the JSON at --out")
    args = parser.parse_args()
    if args.render_only:
        args.out.with_suffix(".md").write_text(render_markdown(json.loads(args.out.read_text())))
        return

    started = time.perf_counter()
    model, tokenizer = load_model()
    text = pydoc_documents(1, chars_per_document=20_000)[0]
    result = {
        "run_info": RunInfo.collect(model).model_dump(),
        "load": load_section(args, model, tokenizer, text),
        "soak": soak_section(args, tokenizer, text),
    }
    result["total_seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(render_markdown(result))
    print(f"wrote {args.out} and its .md in {result['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
