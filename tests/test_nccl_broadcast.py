"""End to end on CPU: FSDP2 trainer ranks -> broadcast -> vLLM's real model classes (TP over gloo),
checked against vLLM's own ``load_weights`` of the trainer's full state dict."""

from __future__ import annotations

import pytest

from weightsync.local.actors import RemoteError
from weightsync.local.cluster import Layout, free_port
from weightsync.transport.nccl import NCCLTrainerInitInfo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def init_info(layout: Layout, bucket_bytes: int = 64 << 10, timeout_s: float = 60.0) -> NCCLTrainerInitInfo:
    return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=1 + layout.num_workers,
                               bucket_bytes=bucket_bytes, device="cpu", timeout_s=timeout_s, rank=0)


def mismatches(cluster) -> dict[str, list[str]]:
    return {k: v for k, v in cluster.verify().items() if v}


@pytest.mark.parametrize("layout", [
    Layout(trainers=2, tp=2, dtype="float32", model="tiny_qwen3"),
    Layout(trainers=2, tp=2, dtype="bfloat16", model="tiny_qwen3"),
    Layout(trainers=2, tp=2, dtype="float32", model="tiny_llama"),
    Layout(trainers=2, tp=2, replicas=2, dtype="float32", model="tiny_qwen3"),
], ids=["qwen3-fp32", "qwen3-bf16", "llama-fp32", "qwen3-2x2"])
def test_broadcast_is_bit_exact_against_vllm_load_weights(cluster, layout):
    cluster.setup(layout, fresh=True)
    cluster.make_engines(init_info(layout))
    assert mismatches(cluster), "receivers start with different weights, so the check can fail"

    stats = cluster.sync(weight_version="v1")
    assert stats["num_steps"] > 1, "the bucket is smaller than the model"
    assert mismatches(cluster) == {}
    assert set(stats["bytes_received_per_worker"]) == set(range(layout.num_workers))
    assert cluster.client().weight_versions() == ["v1"] * layout.num_workers

    cluster.train_step(1)
    assert mismatches(cluster), "an optimizer step changed the trainer's weights"
    cluster.sync(weight_version="v2")
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["v2"] * layout.num_workers


@pytest.mark.parametrize("source, message", [
    ("helpers:bad_shape", r"parameter 'model.layers.1.mlp.up_proj.weight': metadata says .* \(128, 64\), "
                          r"source yielded .* \(127, 64\)"),
    ("helpers:bad_dtype", r"parameter 'model.layers.1.mlp.up_proj.weight': metadata says .*torch.float32.*"
                          r"source yielded .*torch.float16"),
    ("helpers:bad_name", r"parameter 'model.layers.1.mlp.up_proj.weight': .*source yielded "
                         r"'model.layers.1.mlp.up_proj.weight.typo'"),
    ("helpers:stops_early", r"parameter 'model.layers.1.mlp.up_proj.weight': source stopped after"),
])
def test_source_disagreeing_with_metadata_fails_every_rank_and_leaves_workers_unchanged(cluster, source, message):
    layout = Layout(trainers=2, tp=2)
    cluster.setup(layout)
    cluster.make_engines(init_info(layout))
    cluster.sync(weight_version="good")
    before = cluster.on_receivers("checksum")
    cluster.train_step(1)

    cluster.make_engines(init_info(layout), source=source)
    futures = [a.submit("weightsync.local.trainer:send_weights", "bad", timeout_s=120) for a in cluster.active_trainers]
    for f in futures:  # every trainer rank raises, naming the parameter
        with pytest.raises(RemoteError, match=message):
            f.result()
    assert cluster.on_receivers("checksum") == before
    assert cluster.client().weight_versions() == ["good"] * layout.num_workers
