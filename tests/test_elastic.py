"""Elastic replicas (issue 37, docs/elastic.md) on the local harness, M2N and broadcast: with
``on_engine_failure="drop"`` replicas join and leave between syncs (a joining one gets the current
version dense while the others take deltas), a replica whose worker dies or hangs mid-sync is dropped
and reported while the others complete bit-exact, bad input at add is refused naming ``engines[i]``
with the running replicas untouched."""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
from dataclasses import replace

import pytest

from helpers import init_info
from weightsync.registry import transport, transports_with
from weightsync.testing.actors import RemoteError
from weightsync.testing.client import LocalWeightSyncClient
from weightsync.testing.cluster import Layout, model_config_dir

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm]

TIMEOUT_S = 20.0
"""timeout_s of the syncs a dead or hung worker fails: a worker that is gone may be noticed only then."""
BACKENDS = tuple(transports_with("elastic"))
_R = "weightsync.testing.receiver:"


def layout(backend: str, replicas: int = 3) -> Layout:
    return Layout(trainers=2, tp=1, replicas=replicas, backend=backend)


def drop_info(backend: str, replicas: int, **fields):
    return init_info(backend, layout(backend, replicas), timeout_s=TIMEOUT_S, on_engine_failure="drop",
                     delta=True, **fields)


def engine_of(receiver) -> list:
    """A replica (TP 1) as the local client names an engine: its workers' addresses."""
    return [receiver.address]


def start(cluster, backend: str, receivers, **fields) -> None:
    """Elastic engines on every trainer rank for ``receivers`` (one TP-1 replica each)."""
    client = LocalWeightSyncClient([engine_of(r) for r in receivers], timeout_s=TIMEOUT_S)
    cluster.make_engines(drop_info(backend, len(receivers), **fields), client=client)


def on_trainers(cluster, fn: str, engines) -> list:
    return cluster.on_trainers(fn, engines)


def differences(cluster, receivers) -> dict[str, list[str]]:
    """Receiver name -> parameters that differ from vLLM's loader of the trainer's weights (empty: exact)."""
    sd = cluster.on_trainers("full_state_dict")[0]
    return {r.name: bad for r in receivers if (bad := r.call(_R + "compare_with_oracle", sd))}


def versions(receivers) -> list:
    return [r.call(_R + "weight_version") for r in receivers]


@pytest.mark.parametrize("backend", BACKENDS)
def test_replicas_join_leave_and_rejoin_between_syncs(cluster, backend):
    cluster.setup(layout(backend), fresh=True)
    r0, r1, r2 = cluster.receivers[:3]
    start(cluster, backend, [r0, r1])
    stats = cluster.sync("v1")
    assert (stats["replicas"], stats["dropped"]) == ([0, 1], {})
    assert differences(cluster, [r0, r1]) == {} and versions([r0, r1]) == ["v1", "v1"]
    assert versions([r2]) == [None]  # not a member: untouched

    assert on_trainers(cluster, "add_engines", [engine_of(r2)]) == [[2], [2]]
    cluster.train_step(1)
    stats = cluster.sync("v2")
    assert stats["replicas"] == [0, 1, 2]
    assert stats["delta"]["workers"] == [0, 1]  # the members took deltas; the newcomer got v2 dense
    assert differences(cluster, [r0, r1, r2]) == {} and versions([r0, r1, r2]) == ["v2"] * 3

    assert on_trainers(cluster, "remove_engines", [engine_of(r0)]) == [[0], [0]]
    cluster.train_step(2)
    stats = cluster.sync("v3")
    assert stats["replicas"] == [1, 2] and versions([r0, r1, r2]) == ["v2", "v3", "v3"]
    assert differences(cluster, [r1, r2]) == {}

    assert on_trainers(cluster, "add_engines", [engine_of(r0)]) == [[3], [3]]  # back, as a new replica id
    cluster.train_step(3)
    stats = cluster.sync("v4")
    assert stats["replicas"] == [1, 2, 3] and stats["delta"]["workers"] == [1, 2]
    assert differences(cluster, [r0, r1, r2]) == {} and versions([r0, r1, r2]) == ["v4"] * 3
    cluster.on_trainers("shutdown_engine")


def test_an_unpaused_replica_is_refused_naming_it_and_counting_every_replica(cluster):
    """Issue 58: each replica's group asked its own engine only, so the refusal read "engine 0 ... (1 of 1
    engine(s))" with 3 replicas running. Now one question to every replica before any replica's sync."""
    backend = BACKENDS[0]
    cluster.setup(layout(backend), fresh=True)
    rs = cluster.receivers[:3]
    start(cluster, backend, rs)
    cluster.sync("v1")  # inside clients.paused: every replica serves again after it

    def refused() -> list[str]:
        futs = [a.submit("weightsync.testing.trainer:send_weights", "unpaused", pause=False)
                for a in cluster.active_trainers]
        errors = []
        for f in futs:
            with pytest.raises(RemoteError) as e:
                f.result(timeout=4 * TIMEOUT_S)
            errors.append(str(e.value).split("\nTraceback")[0].split(" failed: ", 1)[1])
        return errors

    how = "; call client.pause_generation() before send_weights"
    every = ", ".join(f"engine {i} ({r.name})" for i, r in enumerate(rs))
    for e in refused():  # every rank: the same refusal, naming every replica
        assert e.startswith(f"Refused: weight sync refused: {every}: generation is not paused (3 of 3 "
                            f"engine(s)){how}"), e
    LocalWeightSyncClient([engine_of(r) for r in rs], timeout_s=TIMEOUT_S).pause_generation()
    rs[1].call("weightsync.testing.client:_set", "weightsync_paused", False)  # replica 1 serves again
    for e in refused():
        assert e.startswith(f"Refused: weight sync refused: engine 1 ({rs[1].name}): generation is not paused "
                            f"(1 of 3 engine(s)){how}"), e
    assert versions(rs) == ["v1"] * 3  # nothing moved, nothing dropped
    cluster.train_step(1)
    stats = cluster.sync("v2")
    assert (stats["replicas"], stats["dropped"]) == ([0, 1, 2], {})
    assert differences(cluster, rs) == {} and versions(rs) == ["v2"] * 3
    cluster.on_trainers("shutdown_engine")


def _receiving(receiver, backend: str) -> str:
    """Slow ``receiver``'s data plane (the one ``backend``'s workers join; 0.3 s a call), counting its
    calls in a file: the file has bytes once the receiver is inside a sync's transfer."""
    path = os.path.join(tempfile.mkdtemp(), receiver.name)
    plane = transport(backend).worker_engine.data_plane
    receiver.call("weightsync.testing.faults:slow_data_plane", 0.3, path, f"{plane.__module__}:{plane.__qualname__}")
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_killed_mid_sync_is_dropped_the_others_complete_and_a_new_one_joins(cluster, backend):
    cluster.setup(layout(backend), fresh=True)
    r0, r1, r2 = cluster.receivers[:3]
    start(cluster, backend, [r0, r1, r2])
    cluster.sync("v1")
    cluster.train_step(1)
    count = _receiving(r1, backend)
    futs = [a.submit("weightsync.testing.trainer:send_weights", "v2") for a in cluster.active_trainers]
    deadline = time.monotonic() + 60
    while not (os.path.exists(count) and os.path.getsize(count) >= 1):  # replica 1 is receiving
        assert time.monotonic() < deadline, "replica 1's sync did not get under way"
        time.sleep(0.01)
    t0 = time.monotonic()
    r1.kill()
    stats = [f.result(timeout=4 * TIMEOUT_S) for f in futs]
    assert time.monotonic() - t0 < 2 * TIMEOUT_S  # a gone worker is noticed at the latest at timeout_s
    for s in stats:  # every rank dropped replica 1 alike; the others completed
        assert s["replicas"] == [0, 2] and list(s["dropped"]) == [1], s
        assert "weight sync" in s["dropped"][1] and "failed" in s["dropped"][1]
    assert differences(cluster, [r0, r2]) == {} and versions([r0, r2]) == ["v2", "v2"]

    cluster.train_step(2)  # the engine goes on with the rest
    assert cluster.sync("v3")["replicas"] == [0, 2] and versions([r0, r2]) == ["v3", "v3"]
    assert cluster.replace_dead() == [r1.name]  # a new engine in replica 1's place, added
    new = cluster.receivers[1]
    new.call(_R + "setup", model_config_dir("tiny_qwen3"), tp=1, rank=0, replica=1,
             port=_free_port(), dtype="float32", backend=backend)
    assert on_trainers(cluster, "add_engines", [engine_of(new)]) == [[3], [3]]
    stats = cluster.sync("v4")
    assert stats["replicas"] == [0, 2, 3] and stats["dropped"] == {}
    assert differences(cluster, [r0, new, r2]) == {} and versions([r0, new, r2]) == ["v4"] * 3
    cluster.on_trainers("shutdown_engine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hanging_worker_is_dropped_after_timeout_s_and_can_be_added_back(cluster, backend):
    """A worker alive but not answering (``faults.hang`` in its update call) is dropped once
    ``timeout_s`` passed; the sync completes for the others within ``timeout_s`` + 5 s of its start."""
    cluster.setup(layout(backend))
    r0, r1, r2 = cluster.receivers[:3]
    start(cluster, backend, [r0, r1, r2])
    cluster.sync("v1")
    cluster.train_step(1)
    with socket.create_server(("127.0.0.1", 0)) as release:  # closing it releases the hung worker
        r1.call("weightsync.testing.faults:hang", "update_weights", release.getsockname()[1])
        t0 = time.monotonic()
        stats = cluster.sync("v2")
        elapsed = time.monotonic() - t0
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5, elapsed  # it waited for timeout_s (a real bound), not longer
    assert stats["replicas"] == [0, 2] and list(stats["dropped"]) == [1]
    assert re.search(r"timeout_s=20\.0|[Tt]imed out|within 20\.0 ?s", stats["dropped"][1]), stats["dropped"]
    assert differences(cluster, [r0, r2]) == {} and versions([r0, r2, r1]) == ["v2", "v2", "v1"]
    assert r1.call("weightsync.testing.probes:engine_poisoned")  # its update was aborted; it is poisoned

    assert on_trainers(cluster, "add_engines", [engine_of(r1)]) == [[3], [3]]  # back, once released
    cluster.train_step(2)
    stats = cluster.sync("v3")
    assert stats["replicas"] == [0, 2, 3] and stats["delta"]["workers"] == [0, 2]  # it rejoined dense
    assert differences(cluster, [r0, r1, r2]) == {} and versions([r0, r1, r2]) == ["v3"] * 3
    cluster.on_trainers("shutdown_engine")


@pytest.mark.parametrize("call, rollback", [("finish_weight_update", True), ("finish_weight_update", False),
                                            ("start_weight_update", True)],
                         ids=["finish-rollback", "finish-no-rollback", "start-rollback"])
def test_a_worker_hung_in_its_finish_leaves_its_replica_dropped_poisoned_and_restored(cluster, call, rollback):
    """Issue 57, case 1: TP 2 replicas, 3 trainer ranks (uneven shards), delta. A worker hangs in its
    finish (or its start): its replica is dropped on every rank and the other completes exactly; the
    dropped replica never commits the failed sync on any worker: both its workers are poisoned, and with
    ``rollback`` hold the previous sync's weights (oracle: vLLM's loader of the trainer's previous
    weights), even once the hung call went on. Its version labels are vLLM's (set when a finish returns)."""
    backend = "weightsync_m2n"
    lay = Layout(trainers=3, tp=2, replicas=2, backend=backend)
    cluster.setup(lay)
    a, b = cluster.receivers[0:2], cluster.receivers[2:4]
    client = LocalWeightSyncClient([[r.address for r in a], [r.address for r in b]], timeout_s=TIMEOUT_S)
    cluster.make_engines(init_info(backend, lay, timeout_s=TIMEOUT_S, on_engine_failure="drop", delta=True,
                                   rollback=rollback), client=client)
    cluster.sync("v1")
    previous = cluster.on_trainers("full_state_dict")[0]
    cluster.train_step(1)
    with socket.create_server(("127.0.0.1", 0)) as release:  # closing it releases the hung worker
        b[1].call("weightsync.testing.faults:hang", call, release.getsockname()[1])
        stats = cluster.on_trainers("send_weights", "v2")  # every rank's outcome
    for s in stats:
        assert s["replicas"] == [0] and list(s["dropped"]) == [1], s
    assert differences(cluster, a) == {} and versions(a) == ["v2", "v2"]
    # (each call below waits until the hung finish, and whatever the trainer sent after it, went on)
    poisoned = [r.call("weightsync.testing.probes:engine_poisoned") for r in b]
    assert all(poisoned), f"the dropped replica's workers are not poisoned: {poisoned}"
    labels = versions(b)
    assert labels[0] == labels[1], f"the dropped replica's workers disagree on their version: {labels}"
    if rollback:  # restored on both workers, the one that was hung too
        assert {r.name: r.call(_R + "compare_with_oracle", previous) for r in b} == {r.name: [] for r in b}
    cluster.on_trainers("shutdown_engine")


def test_an_engine_of_another_tp_size_is_refused_at_add_naming_the_field(cluster):
    """Issue 57, case 4: a TP 1 engine added to TP 2 replicas is refused on every rank with the message
    docs/elastic.md quotes (the trainer's ``dst_mesh_dims`` and both worker counts)."""
    backend = "weightsync_m2n"
    lay = Layout(trainers=2, tp=2, replicas=2, backend=backend)
    cluster.setup(lay)
    a, lone = cluster.receivers[0:2], cluster.receivers[2]
    lone.call(_R + "setup", model_config_dir("tiny_qwen3"), tp=1, rank=0, replica=1, port=_free_port(),
              dtype="float32", backend=backend)
    client = LocalWeightSyncClient([[r.address for r in a]], timeout_s=TIMEOUT_S)
    cluster.make_engines(init_info(backend, replace(lay, replicas=1), timeout_s=TIMEOUT_S, on_engine_failure="drop"),
                         client=client)
    cluster.sync("v1")
    futs = [t.submit("weightsync.testing.trainer:add_engines", [lone.address]) for t in cluster.active_trainers]
    for f in futs:  # an entry the client does not take (an address, not a replica's list): every rank, too
        with pytest.raises(RemoteError, match=r"ValueError: engines\[0\] must be a non-empty list of worker addresses"):
            f.result(timeout=4 * TIMEOUT_S)
    futs = [t.submit("weightsync.testing.trainer:add_engines", [engine_of(lone)]) for t in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match=r"engines\[0\]: refused \(.*the trainer's dst_mesh_dims=\(1, 2\) "
                                              r"describes 2 worker\(s\), but the client drives 1 engine\(s\) of 1 "
                                              r"worker\(s\) each"):
            f.result(timeout=4 * TIMEOUT_S)
    cluster.train_step(1)
    assert cluster.sync("v2")["replicas"] == [0] and differences(cluster, a) == {}
    cluster.on_trainers("shutdown_engine")
    cluster.teardown()  # a receiver holds another layout: the next setup rebuilds every one


def test_bad_input_at_add_is_refused_naming_the_field_and_the_replicas_keep_syncing(cluster):
    backend = "weightsync_m2n"
    cluster.setup(layout(backend))
    r0, r1, wide = cluster.receivers[:3]
    wide.call(_R + "setup", model_config_dir("tiny_qwen3_wide"), tp=1, rank=0, replica=2, port=_free_port(),
              dtype="float32", backend=backend)
    start(cluster, backend, [r0, r1])
    cluster.sync("v1")

    def refused(engines, pattern: str) -> None:
        futs = [a.submit("weightsync.testing.trainer:add_engines", engines) for a in cluster.active_trainers]
        for f in futs:  # on every rank, naming the field
            with pytest.raises(RemoteError, match=pattern):
                f.result(timeout=4 * TIMEOUT_S)

    refused([engine_of(r1)], r"ValueError: engines\[0\]: .* is already replica 1 of this trainer")
    refused([engine_of(wide), engine_of(wide)], r"ValueError: engines\[1\]: .* is listed twice")
    # the worker's error reaches the trainers by its destinations key or by the group's failure key,
    # whichever they read first: ``Refused`` naming the same worker, parameter and shapes either way
    refused([engine_of(wide)], r"Refused: engines\[0\]: refused \(worker 0: ValueError: parameter "
                               r"'model\.layers\.0\.mlp\.gate_proj\.weight': "
                               r"the trainer's shape \(128, 64\) does not match .*; the running replicas are untouched")
    cluster.train_step(1)  # the running replicas are untouched
    stats = cluster.sync("v2")
    assert stats["replicas"] == [0, 1] and stats["dropped"] == {}
    assert differences(cluster, [r0, r1]) == {} and versions([r0, r1]) == ["v2", "v2"]
    cluster.on_trainers("shutdown_engine")
    cluster.teardown()  # a receiver holds another model: the next setup rebuilds every one


def test_clients_add_and_remove_engines_naming_the_bad_entry():
    from weightsync import HTTPVLLMWeightSyncClient

    client = HTTPVLLMWeightSyncClient(["http://a:1/"], timeout_s=7.0, token="t")
    client.add_engines(["http://b:2/", "http://c:3"])
    assert client.engines == ["http://a:1", "http://b:2", "http://c:3"]
    with pytest.raises(ValueError, match=r"^engines\[1\]: 'http://a:1' is already one of this client's engines$"):
        client.add_engines(["http://d:4", "http://a:1/"])
    with pytest.raises(ValueError, match=r"^engines\[0\] must be an http\(s\) URL, got 'a:1'$"):
        client.add_engines("a:1")
    with pytest.raises(ValueError, match=r"^engines\[0\]: 'http://z:9' is not one of this client's engines$"):
        client.remove_engines(["http://z:9"])
    assert client.engines == ["http://a:1", "http://b:2", "http://c:3"]  # nothing half-applied
    client.remove_engines("http://b:2")
    one = client.for_engines(["http://c:3"])
    assert (one.engines, one.timeout_s, one.token, client.engines) == (["http://c:3"], 7.0, "t",
                                                                        ["http://a:1", "http://c:3"])


def test_the_policy_is_checked_and_ipc_has_no_per_replica_groups():
    from weightsync.transports.ipc import IPCTrainerInitInfo

    with pytest.raises(ValueError, match=r"M2NTrainerInitInfo\.on_engine_failure must be 'fail' or 'drop', got 'skip'"):
        init_info("weightsync_m2n", layout("weightsync_m2n"), on_engine_failure="skip")
    ipc = IPCTrainerInitInfo.for_deployment(num_trainer_ranks=1, replicas=1, tp=1, on_engine_failure="drop")
    with pytest.raises(ValueError, match=r"on_engine_failure='drop' needs one sync group per replica, which "
                                         r"weightsync_ipc does not have"):
        ipc.for_replica(1, 0)
    m2n = init_info("weightsync_m2n", layout("weightsync_m2n"), on_engine_failure="drop")
    assert m2n.replica_workers(3) == 1
    with pytest.raises(ValueError, match=r"dst_mesh_dims=\(3, 1\) names 3 replica\(s\), but the client drives 2"):
        m2n.replica_workers(2)
    one = m2n.for_replica(1, 1234)
    assert (one.dst_mesh_dims, one.world_size, one.master_port, one.on_engine_failure) == ((1, 1), 3, 1234, "fail")
