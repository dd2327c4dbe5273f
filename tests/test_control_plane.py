"""Trainer rank 0's control plane around the transfer (M2N and the broadcast, whose update is one
call per sync): with a client that may be called from two threads (``concurrent_calls``, as
weightsync's own clients are), the finish call goes out once every worker said on the store that it
applied the update, not when the update call returns; a worker failing after every byte moved still
fails the sync at once, on every trainer rank."""

from __future__ import annotations

import re
import time

import pytest

from helpers import init_info, mismatches
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout
from weightsync.testing.faults import LaggingClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ONE_UPDATE_CALL = ["weightsync_m2n", "weightsync_nccl"]
LAG_S = 1.0
FAST_TIMEOUT_S = 60.0  # a failure every rank reports comes well before it: asserted < FAST_TIMEOUT_S / 2


@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent client", "one call at a time"])
@pytest.mark.parametrize("backend", ONE_UPDATE_CALL)
def test_finish_goes_out_once_every_worker_applied_the_update(cluster, backend, concurrent, tmp_path):
    layout = Layout(trainers=2, tp=2, backend=backend)
    cluster.setup(layout)
    log = tmp_path / "calls"
    client = LaggingClient(cluster.client(), lag_s=LAG_S, log=str(log), concurrent_calls=concurrent)
    cluster.make_engines(init_info(backend, layout), client=client)
    cluster.train_step(3)
    assert mismatches(cluster), "the step changed the weights: the check can fail"
    stats = cluster.sync(weight_version="lagged", verify=True)
    assert log.read_text().split() == (["update", "finish", "returned"] if concurrent
                                       else ["update", "returned", "finish"])
    assert stats["verified"] is True
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["lagged"] * layout.num_workers
    lower = {int(w): n for w, n in stats["lower_bound_per_worker"].items()}
    assert {int(w): n for w, n in stats["bytes_received_per_worker"].items()} == lower  # read off the store


@pytest.mark.parametrize("backend", ONE_UPDATE_CALL)
def test_a_worker_failing_after_every_byte_moved_fails_every_rank_at_once(cluster, backend):
    layout = Layout(trainers=2, tp=2, backend=backend)
    cluster.setup(layout)
    cluster.make_engines(init_info(backend, layout, timeout_s=FAST_TIMEOUT_S))
    cluster.sync(weight_version="good")
    cluster.train_step(4)
    try:
        cluster.on_trainers("weightsync.testing.faults:wrong_checksums", True)
        t0 = time.perf_counter()
        futs = [a.submit("weightsync.testing.trainer:send_weights", "bad", verify=True)
                for a in cluster.active_trainers]
        errors = []
        for f in futs:
            with pytest.raises(RemoteError) as e:
                f.result(timeout=120)
            errors.append(str(e.value).split("\nTraceback")[0])
        elapsed = time.perf_counter() - t0
    finally:
        cluster.on_trainers("weightsync.testing.faults:wrong_checksums", False)
    for err in errors:
        assert re.search(r"SyncFailed: weight sync 2 failed: worker \d: ValueError: verify: worker \d "
                         r"(applied data from trainer rank \d|received buckets) with checksum", err), err
    assert elapsed < FAST_TIMEOUT_S / 2, f"the sync failed after {elapsed:.1f} s (timeout_s={FAST_TIMEOUT_S})"
    assert cluster.client().weight_versions() == ["good"] * layout.num_workers
    cluster.make_engines(init_info(backend, layout))  # a re-init recovers
    cluster.sync(weight_version="recovered", verify=True)
    assert mismatches(cluster) == {}
