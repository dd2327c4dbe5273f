"""vLLM's ``weightsync`` worker backend: one engine serves every transport a trainer names, and an
engine of one transport refuses another transport's init info, naming both (before any rendezvous)."""

from __future__ import annotations

import time

import pytest

from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout, free_port
from weightsync.registry import transport, transport_names

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


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
    assert time.perf_counter() - t0 < 20  # the workers reported it: no rendezvous timeout (60 s) waited out
