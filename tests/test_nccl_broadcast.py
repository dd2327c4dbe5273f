"""End to end on CPU: FSDP2 trainer ranks -> broadcast -> vLLM's real model classes (TP over gloo),
checked against vLLM's own ``load_weights`` of the trainer's full state dict. Faulty sources:
``test_failures.py`` (every transport)."""

from __future__ import annotations

import pytest

from helpers import init_info, mismatches
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.mark.parametrize("layout", [
    Layout(trainers=2, tp=2, dtype="float32", model="tiny_qwen3"),
    Layout(trainers=2, tp=2, dtype="bfloat16", model="tiny_qwen3"),
    Layout(trainers=2, tp=2, dtype="float32", model="tiny_llama"),
    Layout(trainers=2, tp=2, replicas=2, dtype="float32", model="tiny_qwen3"),
], ids=["qwen3-fp32", "qwen3-bf16", "llama-fp32", "qwen3-2x2"])
def test_broadcast_is_bit_exact_against_vllm_load_weights(cluster, layout):
    cluster.setup(layout, fresh=True)
    cluster.make_engines(init_info("weightsync_nccl", layout))
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
