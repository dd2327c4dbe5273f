"""Replica fan-out on the reshard core: the trainer ranks send one replica's worth whatever the
replica count (counted on the data plane's own send and receive ops), every worker receives exactly
its shard bytes once, every replica ends bit-exact, dense then delta, over torch groups (M2N) and
NIXL, with FP8 blocks on the wire; a replica killed in the middle of the fan-out under
on_engine_failure="fail" makes every rank raise."""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time

import pytest

from helpers import init_info, mismatches, until
from test_failures import TIMEOUT, kill_mid_sync, recover_and_verify
from weightsync.registry import transport
from weightsync.testing.client import LocalWeightSyncClient
from weightsync.testing.cluster import Layout, free_port, model_config_dir

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

_R = "weightsync.testing.receiver:"
_COUNTS: dict[str, int] = {}
_ORIGINAL: dict[type, object] = {}


def _plane(backend: str) -> type:
    if backend == "weightsync_nixl":
        from weightsync.dataplane.nixl import NixlPlane

        return NixlPlane
    from weightsync.dataplane.torch_group import TorchGroupPlane

    return TorchGroupPlane


def count_wire(on: bool, backend: str = "weightsync_m2n") -> None:
    """Inside a process: count the bytes of every send and receive op posted on ``backend``'s data
    plane (on), or restore its ``post`` (off)."""
    plane = _plane(backend)
    original = _ORIGINAL.setdefault(plane, plane.post)
    if not on:
        plane.post = original
        return

    def counted(self, sends, recvs):
        _COUNTS["sent"] = _COUNTS.get("sent", 0) + sum(t.nbytes for t, _, _ in sends)
        _COUNTS["received"] = _COUNTS.get("received", 0) + sum(t.nbytes for t, _, _ in recvs)
        return original(self, sends, recvs)

    plane.post = counted


def take_counts() -> dict[str, int]:
    """Inside a process: the bytes counted since the last call (then zeroed)."""
    out = {"sent": _COUNTS.get("sent", 0), "received": _COUNTS.get("received", 0)}
    _COUNTS.clear()
    return out


def counted_sync(cluster, version: str) -> tuple[dict, list[dict], list[dict]]:
    """One sync with every party's data-plane ops counted: rank 0's stats, each trainer rank's and
    each worker's counts."""
    procs, backend = cluster.active_trainers + cluster.active_receivers, cluster.layout.backend
    for a in procs:
        a.call("test_m2n_fanout:count_wire", True, backend)
        a.call("test_m2n_fanout:take_counts")
    try:
        stats = cluster.sync(weight_version=version)
    finally:
        counts = [a.call("test_m2n_fanout:take_counts") for a in procs]
        for a in procs:
            a.call("test_m2n_fanout:count_wire", False, backend)
    n = len(cluster.active_trainers)
    return stats, counts[:n], counts[n:]


def layout(tp: int, replicas: int, backend: str = "weightsync_m2n", **kw) -> Layout:
    return Layout(trainers=2, tp=tp, replicas=replicas, backend=backend, **kw)


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_egress_is_one_replica_whatever_the_replica_count(cluster, tp):
    sent: dict[tuple[int, str], list[int]] = {}
    for replicas, fan_out in ((1, "auto"), (2, "off"), (2, "chain"), (4, "auto"), (4, "tree")):
        lay = layout(tp, replicas, model="small_qwen3")
        cluster.setup(lay, fresh=True)  # (the same seed: the same weights every time)
        cluster.make_engines(init_info("weightsync_m2n", lay, buffer_bytes=1 << 16, fan_out=fan_out), source="local")
        stats, trainers, workers = counted_sync(cluster, f"{replicas}-{fan_out}")
        assert mismatches(cluster) == {}, (replicas, fan_out)
        sent[replicas, fan_out] = [c["sent"] for c in trainers]
        assert all(c["received"] == 0 for c in trainers)
        # every worker received exactly its shard's bytes once, wherever they came from
        lower = stats["lower_bound_per_worker"]
        assert sorted(lower) == list(range(lay.num_workers))
        assert [lower[w] for w in range(lay.num_workers)] == [lower[w % tp] for w in range(lay.num_workers)]
        assert [c["received"] for c in workers] == [lower[w] for w in range(lay.num_workers)], fan_out
        assert stats["bytes_received_per_worker"] == lower
        forwarded = sum(c["sent"] for c in workers)
        assert forwarded == (0 if fan_out == "off" or replicas == 1 else (replicas - 1) * sum(lower[p] for p in
                                                                                             range(tp)))
    one = sent[1, "auto"]
    assert all(s > 0 for s in one)
    for key in ((2, "chain"), (4, "auto"), (4, "tree")):
        assert sent[key] == one, (key, sent)
    assert sent[2, "off"] == [2 * s for s in one]  # without fan-out each trainer rank sends every replica's


def _one_replica_from_the_trainers(stats: dict, trainers: list[dict], workers: list[dict], tp: int,
                                   ids: list[int] | None = None) -> None:
    """Every worker received exactly its shard bytes; the trainers sent exactly what replica 0's workers
    received, and the workers forwarded exactly what the other replicas' workers received: trainer
    egress is one replica's worth. ``ids``: the stats' worker of each of ``workers`` (default: in order)."""
    received = [c["received"] for c in workers]
    lower = stats["lower_bound_per_worker"]
    assert received == [lower[w] for w in (ids if ids is not None else range(len(workers)))]
    assert stats["bytes_received_per_worker"] == lower
    assert sum(c["sent"] for c in trainers) == sum(received[:tp]) > 0
    assert all(c["received"] == 0 for c in trainers)
    assert sum(c["sent"] for c in workers) == sum(received[tp:])


@pytest.mark.parametrize("backend", ["weightsync_m2n", "weightsync_nixl"])
def test_a_chain_is_bit_exact_and_one_replica_from_the_trainers_sync_after_sync(cluster, backend):
    """A chain of 3 replicas (over NIXL, workers READ their pieces from the trainers, replica 0, or from
    their parent worker, which announces what it received): the first sync and the next dense ones,
    whose rounds every party (the relays too) runs compiled, move the same bytes, bit-exact."""
    lay = layout(1, 3, backend=backend)
    cluster.setup(lay, fresh=True)
    cluster.make_engines(init_info(backend, lay, buffer_bytes=1 << 16, fan_out="chain"), source="local")
    for step in range(3):
        cluster.train_step(step + 1)
        stats, trainers, workers = counted_sync(cluster, f"chain-{step}")
        assert mismatches(cluster) == {}, step
        _one_replica_from_the_trainers(stats, trainers, workers, lay.tp)
    compiled = ("__import__('weightsync.testing.actors', fromlist=['STATE'])"
                ".STATE['engine'].plan.rounds.fast is not None")
    assert [r.call("builtins:eval", compiled, {}) for r in cluster.active_receivers] == [True] * 3


@pytest.mark.parametrize("backend", ["weightsync_m2n", "weightsync_nixl"])
def test_fp8_blocks_on_the_wire_go_through_the_fan_out_unchanged(cluster, backend):
    """``fp8_wire``: the trainer ranks quantize once, for replica 0; replica 1 gets the same fp8 bytes
    and scales from replica 0's workers, and both equal vLLM's load of the reference quantization."""
    from test_fp8 import MODEL

    lay = layout(2, 2, dtype="bfloat16", model=MODEL, backend=backend)
    cluster.setup(lay, fresh=True)
    cluster.make_engines(init_info(backend, lay, fp8_wire=True, fan_out="chain"))
    cluster.train_step(21)
    stats, trainers, workers = counted_sync(cluster, "fp8")
    assert sum(b["trainer"] for b in stats["fp8_blocks_per_worker"].values()) > 0  # (fp8 on the wire)
    _one_replica_from_the_trainers(stats, trainers, workers, lay.tp)
    full = cluster.on_trainers("full_state_dict")[0]
    got = cluster.on_receivers("test_fp8:fp8_differences", full)
    assert [g["bad"] for g in got] == [[]] * lay.num_workers
    assert all(len(g["fp8"]) == 8 for g in got)


def test_dense_then_delta_fan_out_unchanged(cluster):
    """A delta sync's sparse messages are forwarded as replica 0 received them: every trainer rank
    sends the same bytes at 1 and 3 replicas, and every replica is bit-exact."""
    per_r = {}
    for replicas in (1, 3):
        lay = layout(1, replicas, dtype="bfloat16", trainer_dtype="float32")
        cluster.setup(lay, fresh=True)
        cluster.make_engines(init_info("weightsync_m2n", lay, buffer_bytes=1 << 16, delta=True, fan_out="chain"),
                             source="local", wire_dtype="bfloat16")
        dense, dense_sent, _ = counted_sync(cluster, "v0")
        assert dense["delta"]["base"] is None and mismatches(cluster) == {}
        cluster.train_step(1, lr=1e-5)
        delta, delta_sent, workers = counted_sync(cluster, "v1")
        assert delta["delta"]["workers"] == list(range(replicas)) and delta["delta"]["base"] == 1
        assert mismatches(cluster) == {}, replicas
        assert len({c["received"] for c in workers}) == 1  # each replica got what replica 0 got
        per_r[replicas] = ([c["sent"] for c in dense_sent], [c["sent"] for c in delta_sent])
    assert per_r[3] == per_r[1]
    assert sum(per_r[1][1]) < sum(per_r[1][0])  # (the delta went sparse)


def test_a_worker_that_lost_its_weights_takes_its_position_dense_in_every_replica(cluster):
    """A delta is forwarded as replica 0 received it, so a position goes sparse only where every
    replica's worker there holds the base: replica 1's worker 1 lost its weights, so position 1 goes
    dense to both replicas (each worker its whole shard), position 0 sparse; all bit-exact."""
    lay = layout(2, 2, dtype="bfloat16", trainer_dtype="float32")
    cluster.setup(lay, fresh=True)
    cluster.make_engines(init_info("weightsync_m2n", lay, delta=True, fan_out="chain"), source="local",
                         wire_dtype="bfloat16")
    cluster.sync("v0")
    cluster.train_step(1, lr=1e-5)
    assert cluster.sync("v1")["delta"]["workers"] == [0, 1, 2, 3]
    cluster.receivers[3].call("test_delta:lose_weights")
    cluster.train_step(2, lr=1e-5)
    stats = cluster.sync("v2", verify=True)
    received, shard = stats["bytes_received_per_worker"], stats["lower_bound_per_worker"]
    assert stats["delta"]["workers"] == [0, 2] and stats["verified"]
    assert received[1] == shard[1] and received[3] == shard[3]
    assert received[0] == received[2] < shard[0]
    assert mismatches(cluster) == {}


def test_a_replica_killed_mid_fan_out_fails_every_rank(cluster):
    """Chain 0 -> 1 -> 2: replica 1's worker dies while the trainers still send; every trainer rank
    raises within the timeout, and replicas 0 and 2 roll back to the last version and refuse updates."""
    lay = layout(1, 3)

    def make_info():
        return init_info("weightsync_m2n", lay, buffer_bytes=1 << 14, timeout_s=TIMEOUT, fan_out="chain")

    elapsed = kill_mid_sync(cluster, lay, make_info(), "local", pick=lambda c: c.receivers[1])
    assert elapsed < 2 * TIMEOUT
    for a in (cluster.receivers[0], cluster.receivers[2]):
        assert a.call("weightsync.testing.receiver:weight_version") == "good"
        assert a.call("weightsync.testing.probes:engine_poisoned")
    recover_and_verify(cluster, lay, make_info, "local")


def test_fan_out_is_validated_naming_the_field():
    lay = layout(1, 2)
    with pytest.raises(ValueError, match="fan_out must be one of 'auto', 'chain', 'tree', 'off', got 'star'"):
        init_info("weightsync_m2n", lay, fan_out="star")
    info = init_info("weightsync_m2n", lay)
    assert info.fan_out == "off"  # (opt-in: docs/benchmarks.md, "Replica fan-out")
    with pytest.raises(ValueError, match="fan_out must be one of"):
        dataclasses.replace(info, fan_out=None)



DROP_TIMEOUT_S = 20.0
"""timeout_s of the drop tests' syncs: a hung worker is noticed only then."""
BACKENDS = ("weightsync_m2n", "weightsync_nixl")


def start_dropping(cluster, backend: str) -> list:
    """A chain over three TP-1 replicas under on_engine_failure="drop" (the elastic engine's one fanned
    group), synced once and trained a step; the three receivers."""
    lay = layout(1, 3, backend)
    cluster.setup(lay, fresh=True)
    rs = cluster.receivers[:3]
    client = LocalWeightSyncClient([[r.address] for r in rs], timeout_s=DROP_TIMEOUT_S)
    cluster.make_engines(init_info(backend, lay, buffer_bytes=1 << 14, timeout_s=DROP_TIMEOUT_S,
                                   on_engine_failure="drop", delta=True, fan_out="chain"), client=client)
    stats, trainers, workers = counted_sync(cluster, "v1")
    assert (stats["replicas"], stats["dropped"]) == ([0, 1, 2], {}) and mismatches(cluster) == {}
    _one_replica_from_the_trainers(stats, trainers, workers, 1)  # one group, fanned out: one replica's egress
    cluster.train_step(1)
    return rs


def dropped_and_exact(cluster, stats: dict, survivors: list, version: str) -> None:
    assert (stats["replicas"], list(stats["dropped"])) == ([0, 2], [1]), stats
    assert "weight sync" in stats["dropped"][1] and "failed" in stats["dropped"][1], stats["dropped"]
    sd = cluster.on_trainers("full_state_dict")[0]
    assert {r.name: bad for r in survivors if (bad := r.call(_R + "compare_with_oracle", sd))} == {}
    assert [r.call(_R + "weight_version") for r in survivors] == [version] * len(survivors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replica_killed_mid_fan_out_under_drop_is_dropped_and_the_ones_behind_it_complete(cluster, backend):
    """Chain 0 -> 1 -> 2 under "drop": replica 1 dies while it forwards; every trainer rank drops it
    alike, replica 2 behind it is fed from the trainers in the same sync (a group over the survivors),
    both survivors end bit-exact at the new version, and the next sync (a delta) goes on without it."""
    r0, r1, r2 = start_dropping(cluster, backend)
    count = os.path.join(tempfile.mkdtemp(), r1.name)
    plane = transport(backend).worker_engine.data_plane
    r1.call("weightsync.testing.faults:slow_data_plane", 0.3, count, f"{plane.__module__}:{plane.__qualname__}")
    futs = [a.submit("weightsync.testing.trainer:send_weights", "v2") for a in cluster.active_trainers]
    until(lambda: os.path.exists(count) and os.path.getsize(count) >= 1, "replica 1 did not start forwarding", 60)
    t0 = time.monotonic()
    r1.kill()
    stats = [f.result(timeout=4 * DROP_TIMEOUT_S) for f in futs]
    elapsed = time.monotonic() - t0
    print(f"{backend}: killed replica 1 dropped, the others synced, {elapsed:.1f} s after the kill")
    assert elapsed < DROP_TIMEOUT_S  # a lost worker is reported by the client at once, on NIXL too: not at timeout_s
    assert stats[1]["dropped"] == stats[0]["dropped"]  # every rank dropped it alike
    dropped_and_exact(cluster, stats[0], [r0, r2], "v2")
    cluster.train_step(2)
    assert (cluster.sync("v3")["replicas"]) == [0, 2]
    dropped_and_exact(cluster, {**stats[0], "replicas": [0, 2]}, [r0, r2], "v3")

    assert cluster.replace_dead() == [r1.name]  # a new engine in replica 1's place joins the fanned group
    new = cluster.receivers[1]
    new.call(_R + "setup", model_config_dir("tiny_qwen3"), tp=1, rank=0, replica=1, port=free_port(),
             dtype="float32", backend=backend)
    assert cluster.on_trainers("add_engines", [[new.address]]) == [[3], [3]]
    cluster.train_step(3)
    stats, trainers, workers = counted_sync(cluster, "v4")
    assert (stats["replicas"], stats["dropped"]) == ([0, 2, 3], {}) and mismatches(cluster) == {}
    _one_replica_from_the_trainers(stats, trainers, workers, 1, ids=[0, 3, 2])  # (the new one is in slot 1)
    assert cluster.on_trainers("remove_engines", [0]) == [[0], [0]]  # (replica ids work too)
    cluster.train_step(4)
    assert cluster.sync("v5")["replicas"] == [2, 3]
    assert [r.call(_R + "weight_version") for r in (r0, r2, new)] == ["v4", "v5", "v5"]
    cluster.on_trainers("shutdown_engine")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replica_hung_in_the_fan_out_under_drop_is_dropped_after_timeout_s(cluster, backend):
    """Replica 1 alive but stuck (its update call hangs): its parent's forward and its child's receive
    wait; after timeout_s every trainer rank drops it (it does not answer), and the survivors complete
    the same sync bit-exact from a group of their own, within timeout_s, the question and a regroup."""
    r0, r1, r2 = start_dropping(cluster, backend)
    with socket.create_server(("127.0.0.1", 0)) as release:  # closing it releases the hung worker
        r1.call("weightsync.testing.faults:hang", "update_weights", release.getsockname()[1])
        t0 = time.monotonic()
        stats = cluster.sync("v2")
        elapsed = time.monotonic() - t0
    print(f"{backend}: hung replica 1 dropped, the others synced, {elapsed:.1f} s after the sync began")
    assert DROP_TIMEOUT_S <= elapsed < DROP_TIMEOUT_S + 30, elapsed  # (+ up to 10 s asking it, then a regroup)
    dropped_and_exact(cluster, stats, [r0, r2], "v2")
    assert r1.call(_R + "weight_version") == "v1"
    cluster.on_trainers("shutdown_engine")
