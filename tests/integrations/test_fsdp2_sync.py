"""``FSDP2Trainer.sync_weights`` into vLLM's real model classes (TP=2 over gloo) for every transport:
after a sync, and again after a training step, every vLLM rank equals vLLM's own ``load_weights`` of
the trainer's full weights, bit for bit."""

from __future__ import annotations

import pytest

from fsdp2_procs import checkpoints, config, make_samples, ranks
from weightsync.local.cluster import Layout, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def init_info(backend: str):
    if backend == "weightsync_ipc":  # colocated: worker w is served by trainer rank w % 2 (shared memory)
        from weightsync.transport.ipc import IPCTrainerInitInfo

        return IPCTrainerInitInfo(num_trainer_ranks=2, num_workers=2, master_port=free_port(), device="cpu",
                                  timeout_s=60, rank=0)
    if backend == "weightsync_nccl":
        from weightsync.transport.nccl import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=3, device="cpu",
                                   timeout_s=60, rank=0)
    from weightsync.transport.m2n import M2NTrainerInitInfo

    return M2NTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=2, world_size=4,
                              dst_mesh_dims=(1, 2), device="cpu", timeout_s=60, rank=0)


@pytest.mark.parametrize("backend", ["weightsync_ipc", "weightsync_nccl", "weightsync_m2n"])
def test_sync_weights_into_vllm_model_classes(cluster, backend):
    procs = ranks()  # starts (or reuses) the two trainer processes while the receivers come up
    cluster.setup(Layout(trainers=0, tp=2, backend=backend))  # the receivers; the trainer ranks are ours
    procs.init(2)
    procs.build(config(checkpoints()))
    procs.run("connect", init_info(backend), cluster.client(timeout_s=60))
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
