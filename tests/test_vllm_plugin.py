"""The ``vllm.general_plugins`` entry point registers every weightsync backend in both of vLLM's
factories, in every process; vLLM's own factories then build and dispatch our engines. Its
``weightsync`` worker backend serves every transport a trainer names, and an engine of one transport
refuses another transport's init info, naming both (before any rendezvous)."""

from __future__ import annotations

import time

import pytest

from helpers import init_info, mismatches
from weightsync.registry import transport, transport_names
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


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
        "weightsync_nixl": {"worker": "NixlWorkerEngine", "worker_is_vllm": True,
                            "trainer": "NixlTrainerEngine", "trainer_is_vllm": True},
    }


def test_vllm_trainer_factory_dispatches_our_init_info_end_to_end(cluster):
    layout = Layout(trainers=2, tp=2, backend="weightsync_m2n")
    cluster.setup(layout)
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local", factory="vllm")
    cluster.train_step(5)
    cluster.sync(weight_version="via-vllm-factory")
    assert mismatches(cluster) == {}


def info_for(name: str, layout: Layout):
    return transport(name).init_info.for_deployment(
        num_trainer_ranks=layout.trainers, replicas=layout.replicas, tp=layout.tp, buffer_bytes=1 << 16,
        master_port=free_port(), device="cpu", timeout_s=60)


def test_one_weightsync_engine_serves_every_transport_in_turn(cluster):
    layout = Layout(trainers=2, tp=2, backend="weightsync")
    cluster.setup(layout, fresh=True)
    for step, name in enumerate(transport_names() * 2):  # each twice, switching every time
        cluster.make_engines(info_for(name, layout))  # the source kind the transport reads
        cluster.train_step(step)
        assert {k: v for k, v in cluster.verify().items() if v}, "the step changed the weights: the check can fail"
        stats = cluster.sync(weight_version=f"{name}-{step}", verify=True)
        assert stats["backend"] == name and stats["verified"] is True
        assert {k: v for k, v in cluster.verify().items() if v} == {}, name
        assert cluster.client().weight_versions() == [f"{name}-{step}"] * 2


def test_an_engine_of_one_transport_refuses_another_transports_init_info(cluster):
    layout = Layout(trainers=2, tp=2, backend="weightsync_m2n")
    cluster.setup(layout)
    info = info_for("weightsync_nccl", layout)
    t0 = time.perf_counter()
    futs = [a.submit("weightsync.testing.trainer:make_engine", info, cluster.client(), source="full")
            for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match=r"init_info.transport is 'weightsync_nccl', but this vLLM engine's "
                                              r"weight-transfer backend is 'weightsync_m2n'"):
            f.result(timeout=120)
    assert time.perf_counter() - t0 < info.timeout_s / 2  # the workers reported it: no rendezvous timeout waited out
