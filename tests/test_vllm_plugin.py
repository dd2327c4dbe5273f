"""The ``vllm.general_plugins`` entry point registers every weightsync backend in both of vLLM's
factories, in every process; vLLM's own factories then build and dispatch our engines."""

from __future__ import annotations

import pytest

from helpers import init_info, mismatches
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_vllm_factories_build_our_engines_for_every_backend(cluster):
    cluster.setup(Layout(trainers=1, tp=1))
    got = cluster.receivers[0].call("weightsync.testing.probes:engine_classes")
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
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local", factory="vllm")
    cluster.train_step(5)
    cluster.sync(weight_version="via-vllm-factory")
    assert mismatches(cluster) == {}
