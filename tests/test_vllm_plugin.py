"""The ``vllm.general_plugins`` entry point registers every weightsync backend in both of vLLM's
factories, in every process; vLLM's own factories then build and dispatch our engines."""

from __future__ import annotations

import pytest

from weightsync.local.cluster import Layout, free_port
from weightsync.transport.m2n import M2NTrainerInitInfo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_vllm_factories_build_our_engines_for_every_backend(cluster):
    cluster.setup(Layout(trainers=1, tp=1))
    got = cluster.receivers[0].call("helpers:engine_classes")
    assert got == {
        "weightsync_nccl": {"worker": "NCCLWorkerEngine", "worker_is_vllm": True,
                            "trainer": "NCCLTrainerEngine", "trainer_is_vllm": True},
        "weightsync_m2n": {"worker": "M2NWorkerEngine", "worker_is_vllm": True,
                           "trainer": "M2NTrainerEngine", "trainer_is_vllm": True},
        "weightsync_ipc": {"worker": "IPCWorkerEngine", "worker_is_vllm": True,
                           "trainer": "IPCTrainerEngine", "trainer_is_vllm": True},
    }


def test_vllm_trainer_factory_dispatches_our_init_info_end_to_end(cluster):
    layout = Layout(trainers=2, tp=2, backend="weightsync_m2n")
    cluster.setup(layout)
    info = M2NTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=2, world_size=4,
                              dst_mesh_dims=(1, 2), device="cpu", timeout_s=60, rank=0)
    cluster.make_engines(info, source="dtensor", factory="vllm")
    cluster.train_step(5)
    cluster.sync(weight_version="via-vllm-factory")
    assert {k: v for k, v in cluster.verify().items() if v} == {}
