"""Agents on a local multi-node Ray cluster (ray.cluster_utils.Cluster: a head and 2 nodes, loopback only), on a
tiny random checkpoint: one pool build per document, one pool transfer per node however many agents call,
answers equal to the single-process run, a killed worker's calls retried on another node, and a lost pool
owner (or the only node holding the pool) recovered from the store or the document."""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

# Without the ray extra these tests are reported as skipped, with this reason (the imports below need Ray).
pytest.importorskip("ray", reason='needs Ray, the ray extra: pip install "polykv-agents[ray]"')

import ray
from langchain_core.messages import HumanMessage, SystemMessage
from ray.cluster_utils import Cluster
from usage import pool_read

from graphs import role_swarm
from polykv_agents import CompressionConfig, default_engine, load_model
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.distributed import RayChatPolyKV, RayCluster
from polykv_agents.distributed.directory import DIRECTORY_NAME, pool_directory

MIB = 2**20
NODE = {"num_cpus": 2, "object_store_memory": 96 * MIB, "node_ip_address": "127.0.0.1"}
WORKER_CPUS = 0.5  # so the clusters of several tests fit on the same nodes
DOCUMENT = [
    {"role": "system", "content": "You are one of several specialists."},
    {"role": "user", "content": "The register lists three risks: drought, ageing mains and workforce. " * 6},
]


@pytest.fixture(scope="module")
def nodes():
    """A head plus 2 worker nodes on loopback; yields the Cluster."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="polykv-tests", _node_ip_address="127.0.0.1")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def namespace(request) -> str:
    """A namespace of the test's own: its own pool directory."""
    return f"polykv-{request.node.name}"[:60]


def wait_until_gone(name: str, namespace: str) -> None:
    for _ in range(50):
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
    raise AssertionError(f"actor {name} is still alive")


def make_cluster(model_dir: str, namespace: str, **kwargs) -> RayCluster:
    return RayCluster(model=model_dir, namespace=namespace, num_cpus=WORKER_CPUS, **kwargs)


def questions(n: int) -> list[list]:
    return [[SystemMessage(f"You are analyst {i}."), HumanMessage("What is the main risk?")] for i in range(n)]


def local_answers(
    model_dir: str, batch: list[list], max_tokens: int, config: CompressionConfig | None = None
) -> list[str]:
    model, tokenizer = load_model(model_dir)
    pool = default_engine().pools.get_or_build(model, tokenizer, DOCUMENT, config=config)
    chat = ChatPolyKV(model=model_dir, max_tokens=max_tokens).with_pool(pool)
    return [chat.invoke(messages).content for messages in batch]


def test_fifteen_agents_build_the_pool_once_and_each_node_fetches_it_once(nodes, tiny_model_dir, namespace):
    cluster = make_cluster(tiny_model_dir, namespace)
    # Uncompressed, so the tiny pool (about 140 KiB) goes through the shared-memory object store: Ray sends objects
    # under 100 KiB inline, with no copy on any node to count.
    config = CompressionConfig.full_precision()
    try:
        handle = cluster.prefetch(DOCUMENT, config=config)
        chat = RayChatPolyKV.on(cluster, ChatPolyKV(model=tiny_model_dir, max_tokens=8)).with_pool(handle)
        answers = chat.batch(questions(15), config={"max_concurrency": 15})

        assert all(pool_read(a) == handle.num_tokens for a in answers)
        assert [a.content for a in answers] == local_answers(tiny_model_dir, questions(15), 8, config)
        assert cluster.directory_stats()["builds"] == {handle.digest: 1}
        stats = cluster.stats()
        assert len(stats) == 3 and sorted(s["calls"] for s in stats) == [5, 5, 5]  # spread over the nodes
        builders = [s for s in stats if s["builds"]]
        assert len(builders) == 1 and builders[0]["fetches"] == {}  # the building node reads its own pool
        fetchers = [s for s in stats if not s["builds"]]
        assert all(s["fetches"] == {handle.digest: 1} for s in fetchers)  # once per node, not per agent
        # What crossed, as Ray itself reports it: the pool's object has one copy per node, of the size fetched.
        location = cluster.pool_locations(handle.digest)
        assert sorted(location["node_ids"]) == sorted(s["node_id"] for s in stats)
        assert all(0 < s["fetched_nbytes"][handle.digest] <= location["object_size"] for s in fetchers)
        store = cluster.object_store_stats()  # each raylet's own counters
        assert store[builders[0]["node_id"]]["primary"] >= location["object_size"]
        assert all(store[s["node_id"]]["secondary"] >= location["object_size"] for s in fetchers)
        assert handle.object_id == cluster.directory_stats()["objects"][handle.digest]
        # Prefetching the same document again (on the next worker in turn) finds the pool: no new build or object.
        assert cluster.prefetch(DOCUMENT, config=config) == handle
        assert cluster.directory_stats()["builds"] == {handle.digest: 1}
        assert cluster.directory_stats()["publications"] == {handle.digest: 1}
    finally:
        cluster.shutdown()


def test_a_graph_dispatched_to_the_cluster_answers_as_the_single_process_run(nodes, tiny_model_dir, namespace):
    cluster = make_cluster(tiny_model_dir, namespace)
    chat = ChatPolyKV(model=tiny_model_dir, max_tokens=8)
    inputs = {"document": DOCUMENT[1]["content"], "question": "What is the main risk?", "roles": ["a", "b", "c", "d"]}
    try:
        remote = role_swarm.build_graph(chat=chat, cluster=cluster).invoke(inputs)
        local = role_swarm.build_graph(chat=chat).invoke(inputs)
        assert remote["answers"] and sorted(map(str, remote["answers"])) == sorted(map(str, local["answers"]))
        assert remote["answer"] == local["answer"]
        assert remote["pool"]["digest"] == local["pool"]["digest"] and remote["pool"]["object_id"] is not None
        assert cluster.directory_stats()["builds"] == {remote["pool"]["digest"]: 1}
        with pytest.raises(ValueError, match="serves the one model it was started with"):  # the run's context
            role_swarm.build_graph(chat=chat, cluster=cluster).invoke(inputs, context={"model": "another/model"})
    finally:
        cluster.shutdown()


def test_the_calls_of_a_killed_worker_are_retried_on_another_node(nodes, tiny_model_dir, namespace, caplog):
    cluster = make_cluster(tiny_model_dir, namespace)
    try:
        handle = cluster.prefetch(DOCUMENT)
        # Long answers (160 tokens), so the kill lands while the victim's calls are decoding.
        chat = RayChatPolyKV.on(cluster, ChatPolyKV(model=tiny_model_dir, max_tokens=160)).with_pool(handle)
        batch = questions(9)
        cluster.warm_up()
        victim_node, victim = sorted(cluster.workers().items())[1]
        victim_pid = ray.get(victim.stats.remote())["pid"]

        def kill_mid_call() -> None:
            # stats runs in the workers' control group, so it answers while the victim decodes.
            while ray.get(victim.stats.remote())["calls"] == 0:
                time.sleep(0.02)
            os.kill(victim_pid, signal.SIGKILL)

        with (
            caplog.at_level(logging.WARNING, logger="polykv_agents.distributed.cluster"),
            ThreadPoolExecutor(1) as pool,
        ):
            killer = pool.submit(kill_mid_call)
            answers = chat.batch(batch, config={"max_concurrency": 9})
            killer.result()
        assert [a.content for a in answers] == local_answers(tiny_model_dir, batch, 160)
        assert "sending the call to another node" in caplog.text  # its calls were retried ...
        assert victim_node not in cluster.workers() and len(cluster.workers()) == 2  # ... and the run went on
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("with_store", [True, False])
def test_a_lost_pool_owner_is_recovered_from_the_store_or_the_document(
    nodes, tiny_model_dir, namespace, tmp_path, with_store
):
    first = make_cluster(tiny_model_dir, namespace)
    handle = first.prefetch(DOCUMENT, store_dir=str(tmp_path) if with_store else None)
    first.shutdown()
    ray.kill(pool_directory(namespace))  # the owner of every published pool of this namespace
    wait_until_gone(DIRECTORY_NAME, namespace)
    second = make_cluster(tiny_model_dir, namespace)  # fresh workers: no node holds the pool any more
    try:
        chat = RayChatPolyKV.on(second, ChatPolyKV(model=tiny_model_dir, max_tokens=8))
        chat = chat.with_pool(handle, document=DOCUMENT)
        answers = [chat.invoke(messages).content for messages in questions(3)]
        assert answers == local_answers(tiny_model_dir, questions(3), 8)
        builds = sum(s["builds"].get(handle.digest, 0) for s in second.stats())
        assert builds == (0 if with_store else 1)  # loaded from the store, else rebuilt from the document
        assert second.directory_stats()["publications"] == {handle.digest: 1}  # and published again
    finally:
        second.shutdown()


def test_a_pool_whose_only_node_is_lost_is_rebuilt_from_the_document(nodes, tiny_model_dir, namespace):
    """Last in this module: it removes a node for good."""
    survivors = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    doomed = nodes.add_node(**NODE)
    nodes.wait_for_nodes()
    builder = make_cluster(tiny_model_dir, namespace, nodes=[doomed.node_id])
    # Uncompressed, so the pool goes to the object store of the doomed node: a smaller one would be kept inline,
    # by its owner, the directory (which lives on the head).
    config = CompressionConfig.full_precision()
    handle = builder.prefetch(DOCUMENT, config=config)
    nodes.remove_node(doomed)
    others = make_cluster(tiny_model_dir, namespace, nodes=survivors)
    try:
        chat = RayChatPolyKV.on(others, ChatPolyKV(model=tiny_model_dir, max_tokens=8))
        chat = chat.with_pool(handle, document=DOCUMENT)
        assert chat.invoke(questions(1)[0]).content == local_answers(tiny_model_dir, questions(1), 8, config)[0]
        assert sum(s["builds"].get(handle.digest, 0) for s in others.stats()) == 1
    finally:
        others.shutdown()
