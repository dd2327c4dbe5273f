"""``FSDP2Trainer.sync_weights`` into vLLM's real model classes (TP=2 over gloo) for every transport:
after a sync, and again after a training step, every vLLM rank equals vLLM's own ``load_weights`` of
the trainer's full weights, bit for bit."""

from __future__ import annotations

import pytest

from helpers import TRANSPORTS, checkpoints, config, init_info, make_samples, ranks
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_sync_weights_into_vllm_model_classes(cluster, backend):
    procs = ranks()  # starts (or reuses) the two trainer processes while the receivers come up
    cluster.setup(Layout(trainers=0, tp=2, backend=backend))  # the receivers; the trainer ranks are ours
    procs.init(2)
    procs.build(config(checkpoints()))
    procs.run("connect", init_info(backend, Layout(trainers=2, tp=2)), cluster.client(timeout_s=60))
    try:
        for step in range(2):
            if step:
                procs.run("call", "train_step", make_samples(2, 4, seed=20 + step))
            weights = procs.run("call", "full_state_dict")[0]
            assert any(cluster.on_receivers("compare_with_oracle", weights)), "vLLM already had these weights"
            procs.run("sync", f"v{step}")
            assert cluster.on_receivers("compare_with_oracle", weights) == [[], []]
        assert cluster.client().weight_versions() == ["v1", "v1"]
    finally:
        procs.run("shutdown_engine")
