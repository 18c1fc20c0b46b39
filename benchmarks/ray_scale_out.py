"""15 agents over one pool on a local Ray cluster: 3 simulated nodes against 1.

    python benchmarks/ray_scale_out.py --out benchmarks/results/ray_scale_out.json

Each configuration starts its own cluster on this machine (``ray.cluster_utils.Cluster``, loopback only): one
node with 2 CPUs, or a head and 2 more nodes with 1 CPU each (Ray gives a worker as many torch threads as
CPUs). Every node runs one NodeWorker, one SmolLM2-135M-Instruct replica. The driver prefetches the bundled
sample document once (one worker prefills, compresses and publishes the pool), then sends 15 agent calls
(15 role prompts, greedy, 16 tokens) from 15 threads: 1 warm-up, then the median of 3 repetitions.

Measured, per configuration: pool builds (the pool directory's count); bytes transferred (each node's object
store counters from its raylet: the pool's copy pulled into a node is its secondary bytes; the bytes of the
pool arrays each node received, measured there; Ray's own count of copies); wall time of the 15 calls; and per
node the worker's RSS and USS (its private pages) and the node's object-store bytes. The answers of both
configurations are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from importlib import resources
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; before Ray is imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
from langchain_core.messages import HumanMessage, SystemMessage
from ray.cluster_utils import Cluster

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import MIB, column, markdown_table, mib_column
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.distributed import RayChatPolyKV, RayCluster
from polykv_agents.graph.prefetch import DEFAULT_SHARED_PROMPT
from polykv_agents.model.loading import DEFAULT_MODEL, load_model

AGENTS = 15
ROLES = [
    "legal", "finance", "engineering", "risk", "operations", "security", "environment", "customer",
    "communications", "hr", "procurement", "quality", "audit", "strategy", "data",
]  # fmt: skip


def document() -> list[dict[str, str]]:
    text = resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    return [{"role": "system", "content": DEFAULT_SHARED_PROMPT}, {"role": "user", "content": text}]


def questions() -> list[list]:
    return [
        [SystemMessage(f"You are the {role} specialist."), HumanMessage("What is the most important finding?")]
        for role in ROLES[:AGENTS]
    ]


def run_configuration(nodes: int, cpus_per_node: int, repetitions: int, max_tokens: int) -> dict:
    node = {"num_cpus": cpus_per_node, "object_store_memory": 256 * MIB, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="polykv-bench", _node_ip_address="127.0.0.1")
    try:
        remote = RayCluster(model=DEFAULT_MODEL, namespace="polykv-bench", num_cpus=cpus_per_node)
        started = time.perf_counter()
        load_seconds = remote.warm_up()
        warm_up_seconds = time.perf_counter() - started
        started = time.perf_counter()
        handle = remote.prefetch(document())
        prefetch_seconds = time.perf_counter() - started
        chat = RayChatPolyKV.on(remote, ChatPolyKV(max_tokens=max_tokens)).with_pool(handle)
        walls, answers, tokens = [], None, 0
        for repetition in range(repetitions + 1):  # repetition 0 is the warm-up (and the nodes' one fetch)
            started = time.perf_counter()
            replies = chat.batch(questions(), config={"max_concurrency": AGENTS})
            if repetition:
                walls.append(time.perf_counter() - started)
            answers = [reply.content for reply in replies]
            tokens = sum(reply.usage_metadata["output_tokens"] for reply in replies)
            assert all(r.usage_metadata["input_token_details"]["cache_read"] == handle.num_tokens for r in replies)
        workers = {s["node_id"]: s for s in remote.stats()}
        stores = remote.object_store_stats()
        location = remote.pool_locations(handle.digest)
        per_node = [
            {
                "node": node_id[:8],
                "calls": workers[node_id]["calls"],
                "pool_fetches": workers[node_id]["fetches"].get(handle.digest, 0),
                "pool_builds": workers[node_id]["builds"].get(handle.digest, 0),
                "received_pool_bytes": workers[node_id]["fetched_nbytes"].get(handle.digest, 0),
                "store_secondary_bytes": stores[node_id]["secondary"],
                "store_used_bytes": stores[node_id]["used"],
                "worker_rss_bytes": workers[node_id]["rss_bytes"],
                "worker_uss_bytes": workers[node_id]["uss_bytes"],
                "model_load_seconds": load_seconds[node_id],
            }
            for node_id in sorted(workers)
        ]
        return {
            "nodes": nodes,
            "cpus_per_node": cpus_per_node,
            "pool_tokens": handle.num_tokens,
            "pool_nbytes": handle.nbytes,
            "pool_builds": remote.directory_stats()["builds"].get(handle.digest, 0),
            "pool_copies": len(location["node_ids"]),
            "pool_object_bytes": location["object_size"],
            "bytes_transferred": sum(n["store_secondary_bytes"] for n in per_node),
            "received_pool_bytes": sum(n["received_pool_bytes"] for n in per_node),
            "warm_up_seconds": warm_up_seconds,
            "prefetch_seconds": prefetch_seconds,
            "wall_seconds": statistics.median(walls),
            "wall_samples": walls,
            "tokens_per_second": tokens / statistics.median(walls),  # the answers' own token counts
            "per_node": per_node,
            "answers": answers,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ray_scale_out.json"))
    args = parser.parse_args()

    rows = [
        run_configuration(1, 2, args.repetitions, args.max_tokens),
        run_configuration(3, 1, args.repetitions, args.max_tokens),
    ]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k not in ("answers", "per_node")}), flush=True)
    same = rows[0]["answers"] == rows[1]["answers"]
    model, _ = load_model()
    info = RunInfo.collect(model).model_dump()
    result = {"run_info": info, "agents": AGENTS, "max_tokens": args.max_tokens, "repetitions": args.repetitions}
    result |= {"rows": rows, "answers_equal_across_configurations": same}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))

    summary = markdown_table(
        rows,
        [
            column("nodes", "nodes"),
            column("CPUs per node", "cpus_per_node"),
            column("pool builds", "pool_builds"),
            column("pool copies (Ray)", "pool_copies"),
            column("bytes transferred (object stores)", "bytes_transferred", "{:,}"),
            column("pool bytes received (nodes)", "received_pool_bytes", "{:,}"),
            column("15 calls, wall s (median)", "wall_seconds", "{:.2f}"),
            column("tok/s", "tokens_per_second", "{:.1f}"),
            column("prefetch s", "prefetch_seconds", "{:.2f}"),
        ],
    )
    nodes_table = markdown_table(
        [{"nodes": row["nodes"], **node} for row in rows for node in row["per_node"]],
        [
            column("cluster", "nodes", "{} node(s)"),
            column("node", "node"),
            column("calls", "calls"),
            column("pool fetches", "pool_fetches"),
            column("pool builds", "pool_builds"),
            mib_column("object store MiB", "store_used_bytes", 2),
            mib_column("worker RSS MiB", "worker_rss_bytes", 0),
            mib_column("worker USS MiB", "worker_uss_bytes", 0),
        ],
    )
    conditions = (
        f"Machine: {info['machine']}, {info['cpu']}, {info['cpu_count']} cores (every simulated node shares them). "
        f"Model: {info['model']} ({info['dtype']}), one replica per node. Pool: {rows[0]['pool_tokens']} tokens "
        f"(the bundled sample), {rows[0]['pool_nbytes']:,} bytes compressed. {AGENTS} agents, {args.max_tokens} "
        f"tokens each, greedy; median of {args.repetitions} after 1 warm-up. {info['date']}. Answers equal across "
        f"the two configurations: {same}."
    )
    markdown = f"# Ray scale-out\n\n{conditions}\n\n{summary}\n\nPer node:\n\n{nodes_table}\n"
    args.out.with_suffix(".md").write_text(markdown, encoding="utf-8")


if __name__ == "__main__":
    main()
