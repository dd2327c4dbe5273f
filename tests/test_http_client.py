"""HTTPVLLMWeightSyncClient against vLLM's own RL router (FastAPI, loopback) in front of real
receiver processes: vLLM's request types accept our requests and a sync lands bit-exact."""

from __future__ import annotations

import pytest

from helpers import init_info, mismatches
from weightsync import HTTPVLLMWeightSyncClient, RemoteCallError
from weightsync.clients import paused
from weightsync.testing.actors import Actor
from weightsync.testing.cluster import Layout, free_port
from weightsync.testing.receiver import VLLM_CPU_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def http_server(cluster):
    layout = Layout(trainers=2, tp=2, replicas=1, backend="weightsync_m2n")
    cluster.setup(layout)
    actor = Actor("http", VLLM_CPU_ENV)
    port = free_port()
    actor.call("weightsync.testing.client:serve_http", [[a.address for a in cluster.active_receivers]], port)
    yield f"http://127.0.0.1:{port}", actor, layout
    actor.close()


def test_sync_through_vllm_http_routes_is_bit_exact(cluster, http_server):
    url, actor, layout = http_server
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local", client=HTTPVLLMWeightSyncClient(url))
    cluster.train_step(3)
    cluster.sync(weight_version="http-v1")
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["http-v1", "http-v1"]
    calls = actor.call("weightsync.testing.client:http_calls")
    assert calls[0] == ("init", "WeightTransferInitRequest")
    assert calls[-3:] == [("start",), ("update", "WeightTransferUpdateRequest"), ("finish", "http-v1")]


def test_http_errors_carry_status_and_pause_modes_reach_vllm(http_server):
    url, actor, _ = http_server
    client = HTTPVLLMWeightSyncClient(url)
    with pytest.raises(RemoteCallError, match=r"POST .*/update_weights -> HTTP 422"):
        client._post("update_weights", {"wrong": 1})  # vLLM's own validation rejects the body
    with paused(client, mode="wait", clear_cache=False):
        pass
    assert actor.call("weightsync.testing.client:http_calls")[-2:] == [("pause", "wait", False), ("resume",)]
    with pytest.raises(ValueError, match=r"mode must be one of \('abort', 'wait', 'keep'\), got 'drain'"):
        client.pause_generation(mode="drain")
    with pytest.raises(ValueError, match="base_url must be http"):
        HTTPVLLMWeightSyncClient("localhost:8000")
