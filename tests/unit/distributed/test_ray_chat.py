"""RayChatPolyKV and RayCluster without a running cluster (constructing either starts nothing): settings kept,
the cluster's model enforced, copies sharing the cluster, handles validated."""

from __future__ import annotations

import copy

import pytest
from langchain_core.runnables import ConfigurableField

from polykv_agents import SharedKVPool
from polykv_agents.chat.chat_model import ChatPolyKV
from polykv_agents.graph.workflow import role_chat_model
from polykv_agents.pool.handle import PoolHandle

# Without the ray extra these tests are reported as skipped, with this reason (polykv_agents.distributed imports Ray).
pytest.importorskip("ray", reason='needs Ray, the ray extra: pip install "polykv-agents[ray]"')

from polykv_agents.distributed import RayChatPolyKV, RayCluster


@pytest.fixture
def cluster() -> RayCluster:
    return RayCluster(model="SmolLM2-135M-Instruct", device="cpu")


def test_every_setting_of_the_chat_model_is_kept(cluster):
    chat = ChatPolyKV(max_tokens=7, temperature=0.5, seed=3, tags=["review"], metadata={"team": "a"})
    remote = RayChatPolyKV.on(cluster, chat)
    assert (remote.max_tokens, remote.temperature, remote.seed) == (7, 0.5, 3)
    assert remote.tags == ["review"] and remote.metadata["team"] == "a"
    assert remote.cluster is cluster
    assert "cluster" not in remote.model_dump()  # process-local, like a client


def test_the_chat_model_must_run_the_clusters_model(cluster):
    with pytest.raises(ValueError, match="the cluster's nodes load 'SmolLM2-135M-Instruct'"):
        RayChatPolyKV.on(cluster, ChatPolyKV(model="another-model"))
    gpu = RayCluster(device="cuda")
    assert gpu.num_gpus == 1 and cluster.num_gpus == 0
    assert RayChatPolyKV.on(gpu).device == "cuda"  # the default chat model follows the cluster
    assert role_chat_model(None, 5, default_max_tokens=9, cluster=gpu).device == "cuda"


def test_copies_and_configurable_fields_keep_the_cluster(cluster):
    remote = RayChatPolyKV.on(cluster, ChatPolyKV(max_tokens=4))
    assert copy.deepcopy(remote).cluster is cluster
    assert remote.model_copy(update={"max_tokens": 2}).cluster is cluster
    configurable = remote.configurable_fields(max_tokens=ConfigurableField(id="max_tokens"))
    assert configurable.with_config(configurable={"max_tokens": 3}) is not None


def test_a_handle_given_as_a_dict_is_validated(cluster, tiny_model, tiny_tok):
    """What a strict checkpoint serializer hands back: the handle's fields as a dict."""
    handle = PoolHandle.from_pool(SharedKVPool.prefill(tiny_model, tiny_tok, "The register lists three risks."))
    for chat in (ChatPolyKV(), RayChatPolyKV.on(cluster)):
        bound = chat.with_pool(handle.model_dump(mode="json"))
        assert isinstance(bound.pool, PoolHandle) and bound.pool == handle
