"""``python -m benchmarks ray_scale_out``: 15 agents over one pool on a local Ray cluster, 3 simulated nodes
against 1.

Each configuration starts its own cluster on this machine (``ray.cluster_utils.Cluster``, loopback only): one
node with 2 CPUs, or a head and 2 more nodes with 1 CPU each (Ray gives a worker as many torch threads as
CPUs). Every node runs one NodeWorker, one SmolLM2-135M-Instruct replica. The driver prefetches the bundled
sample document once (one worker prefills, compresses and publishes the pool), then sends 15 agent calls
(15 role prompts, greedy, ``max_tokens`` tokens) from 15 threads: 1 warm-up, then the median of
``repetitions``.

Measured, per configuration: pool builds (the pool directory's count); bytes transferred (each node's object
store counters from its raylet: the pool's copy pulled into a node is its secondary bytes; the bytes of the
pool arrays each node received, measured there; Ray's own count of copies); wall time of the 15 calls; and per
node the worker's RSS and USS (its private pages) and the node's object-store bytes. The answers of both
configurations are compared.
"""

from __future__ import annotations

import os
import statistics
import time
from importlib import resources
from typing import Any

from pydantic import BaseModel, Field

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import MIB, Progress, column, markdown_table, mib_column
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for

AGENTS = 15
ROLES = [
    "legal", "finance", "engineering", "risk", "operations", "security", "environment", "customer",
    "communications", "hr", "procurement", "quality", "audit", "strategy", "data",
]  # fmt: skip
CONFIGURATIONS = ((1, 2), (3, 1))
"""(nodes, CPUs per node): one node with both cores, three sharing them."""


class RayScaleOutOptions(SuiteOptions):
    repetitions: int = Field(default=3, ge=1)
    """Timed rounds of 15 calls after one warm-up."""
    max_tokens: int = Field(default=16, ge=1)
    """Tokens per answer."""


class RayScaleOutResult(BaseModel):
    run_info: RunInfo
    agents: int
    max_tokens: int
    repetitions: int
    rows: list[dict[str, Any]]
    answers_equal_across_configurations: bool


def _document() -> list[dict[str, str]]:
    from polykv_agents.graph.prefetch import DEFAULT_SHARED_PROMPT

    text = resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")
    return [{"role": "system", "content": DEFAULT_SHARED_PROMPT}, {"role": "user", "content": text}]


def _questions() -> list[list]:
    from langchain_core.messages import HumanMessage, SystemMessage

    return [
        [SystemMessage(f"You are the {role} specialist."), HumanMessage("What is the most important finding?")]
        for role in ROLES[:AGENTS]
    ]


def run_configuration(nodes: int, cpus_per_node: int, repetitions: int, max_tokens: int) -> dict:
    """Start a local cluster of ``nodes`` nodes, prefetch once, time ``repetitions`` rounds, shut it down."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; before Ray is imported
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    from polykv_agents.chat.chat_model import ChatPolyKV
    from polykv_agents.distributed import RayChatPolyKV, RayCluster
    from polykv_agents.model.loading import DEFAULT_MODEL

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
        handle = remote.prefetch(_document())
        prefetch_seconds = time.perf_counter() - started
        chat = RayChatPolyKV.on(remote, ChatPolyKV(max_tokens=max_tokens)).with_pool(handle)
        walls, answers, tokens = [], None, 0
        for repetition in range(repetitions + 1):  # repetition 0 is the warm-up (and the nodes' one fetch)
            started = time.perf_counter()
            replies = chat.batch(_questions(), config={"max_concurrency": AGENTS})
            if repetition:
                walls.append(time.perf_counter() - started)
            answers = [reply.content for reply in replies]
            tokens = sum(reply.usage_metadata["output_tokens"] for reply in replies)
            if any(r.usage_metadata["input_token_details"]["cache_read"] != handle.num_tokens for r in replies):
                msg = "a call did not read the whole document from the pool"
                raise RuntimeError(msg)
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


def render_markdown(result: RayScaleOutResult) -> str:
    """The full tables (benchmarks/results/ray_scale_out.md)."""
    rows, info = result.rows, result.run_info
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
        f"Machine: {info.machine}, {info.cpu}, {info.cpu_count} cores (every simulated node shares them). "
        f"Model: {info.model} ({info.dtype}), one replica per node. Pool: {rows[0]['pool_tokens']} tokens "
        f"(the bundled sample), {rows[0]['pool_nbytes']:,} bytes compressed. {result.agents} agents, "
        f"{result.max_tokens} tokens each, greedy; median of {result.repetitions} after 1 warm-up. {info.date}. "
        f"{info.commit_sentence()} "
        f"Answers equal across the two configurations: {result.answers_equal_across_configurations}."
    )
    return f"# Ray scale-out\n\n{conditions}\n\n{summary}\n\nPer node:\n\n{nodes_table}\n"


def _range(values: list[float], fmt: str = "{:,.0f}") -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


def docs_table(result: RayScaleOutResult) -> str:
    """docs/DISTRIBUTED.md's comparison: conditions, then one column per configuration."""
    rows, info = result.rows, result.run_info
    first = rows[0]

    def cell(row: dict) -> dict[str, str]:
        nodes = row["per_node"]
        copies = row["nodes"] - 1
        transferred = f"{row['bytes_transferred']:,}"
        if row["bytes_transferred"]:
            transferred += f" ({copies} x {row['pool_object_bytes'] / 1e6:.2f} MB)"
        rss = _range([n["worker_rss_bytes"] / MIB for n in nodes])
        uss = _range([n["worker_uss_bytes"] / MIB for n in nodes])
        return {
            "pool builds (directory)": f"{row['pool_builds']}",
            "pool copies (Ray's object directory)": f"{row['pool_copies']}",
            "bytes transferred (raylets' secondary bytes)": transferred,
            "pool bytes received, measured at the nodes": f"{row['received_pool_bytes']:,}",
            f"{result.agents} calls, wall time": f"{row['wall_seconds']:.2f} s",
            "prefetch (prefill, compress, publish)": f"{row['prefetch_seconds']:.1f} s",
            "per node: worker RSS / USS": f"{rss} / {uss} MiB",
            "per node: object store": f"{_range([n['store_used_bytes'] / MIB for n in nodes], '{:.2f}')} MiB",
        }

    cells = [cell(row) for row in rows]
    headers = [
        f"{row['nodes']} node{'s' if row['nodes'] > 1 else ''} ({row['cpus_per_node']} CPU"
        f"{'s' if row['cpus_per_node'] > 1 else ''}{' each' if row['nodes'] > 1 else ''})"
        for row in rows
    ]
    lines = [
        f"Machine: {info.machine.split()[-1]}, {info.cpu_count} cores (the simulated nodes share them), torch "
        f"{info.torch}. Model: {info.model} in {info.dtype.replace('float', 'fp')}, one replica per node. Pool: the "
        f"bundled sample, {first['pool_tokens']:,} tokens, {first['pool_nbytes']:,} bytes compressed "
        f"({first['pool_object_bytes']:,} as one object-store object). {result.agents} agents, {result.max_tokens} "
        f"tokens each, greedy; median of {result.repetitions} runs after 1 warm-up. {info.commit_sentence()}",
        "",
        "| | " + " | ".join(headers) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    lines += [f"| {key} | " + " | ".join(c[key] for c in cells) + " |" for key in cells[0]]
    return "\n".join(lines)


class RayScaleOutSuite(JsonSuite[RayScaleOutResult]):
    name = "ray_scale_out"
    summary = "15 agents over one pool on a local Ray cluster: 3 simulated nodes against 1."
    result_type = RayScaleOutResult
    options = RayScaleOutOptions
    reproduce = ((),)

    def run(self, options: RayScaleOutOptions, progress: Progress) -> RayScaleOutResult:
        rows = []
        for nodes, cpus in CONFIGURATIONS:
            progress(f"{nodes} node(s), {cpus} CPU(s) each")
            rows.append(run_configuration(nodes, cpus, options.repetitions, options.max_tokens))
        model, _ = load_model_for(None)  # the replicas' model, for the run's conditions
        return RayScaleOutResult(
            run_info=RunInfo.collect(model), agents=AGENTS, max_tokens=options.max_tokens,
            repetitions=options.repetitions, rows=rows,
            answers_equal_across_configurations=all(r["answers"] == rows[0]["answers"] for r in rows),
        )  # fmt: skip

    def markdown(self, result: RayScaleOutResult) -> str:
        return render_markdown(result)

    def rendered(self, result: RayScaleOutResult) -> Rendered:
        return Rendered(blocks={"ray_scale_out": docs_table(result)})


SUITE = RayScaleOutSuite()
